"""GGUF -> HF checkpoint conversion, checked against transformers' own GGUF loader (the oracle)."""
import os
import shutil

import numpy as np
import pytest
import torch

import transformers
import gguf
import accelerate  # noqa: F401  transformers needs it to load a GGUF model

from safetensors import safe_open  # noqa: E402

from graft_tk.errors import CorruptFileError, ModelNotFoundError, UnsupportedModelError  # noqa: E402
from graft_tk.models.gguf import _unpermute, convert_gguf  # noqa: E402

TEXTS = [
    "12345",
    "a 12 b 3.14159 x1y22 1,000,000",
    "def f(x):\n    return x**2\n\n\n\tif  a:\n\t\tpass  \n",
    "```python\nimport numpy as np\nprint(np.arange(10)[::-1])\n```",
    "Héllo wörld — naïve café 三百 日本語のテキスト 😀👍🏽 Ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>x <file_sep>",
    "  leading and trailing   ",
    "I'm can't WE'LL they're",
    "\r\n\r\nwindows\r\n",
    "",
]


@pytest.fixture(scope="session")
def converted(smollm2_gguf, tmp_path_factory):
    return convert_gguf(smollm2_gguf, tmp_path_factory.mktemp("conv") / "smollm2", progress=False)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm2_gguf):
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def our_tokenizer(converted):
    return transformers.AutoTokenizer.from_pretrained(converted)


def _assert_same_state_dict(ours_dir, gguf_path):
    want = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(ours_dir).state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], want[name]), f"{name}: max diff {(got[name] - want[name]).abs().max()}"


def test_state_dict_matches_transformers_gguf_loader(converted, smollm2_gguf):
    """Every tensor, q/k un-permuted included, equals what transformers dequantises, bit for bit."""
    _assert_same_state_dict(converted, smollm2_gguf)
    config = transformers.AutoConfig.from_pretrained(converted)
    assert (config.model_type, config.num_key_value_heads, config.head_dim) == ("llama", 3, 64)
    assert config.tie_word_embeddings
    with safe_open(converted / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: the head is the embedding


def test_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's convert_hf_to_gguf.py permutes q/k rows as below; we undo exactly that."""
    n_head, head_dim, cols = 3, 8, 5
    hf = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    llama_cpp = hf.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(llama_cpp, hf)
    assert np.array_equal(_unpermute(llama_cpp, n_head), hf)


def test_tokenizer_matches_transformers_gguf_tokenizer(our_tokenizer, hf_gguf_tokenizer):
    assert len(our_tokenizer) == len(hf_gguf_tokenizer) == 49152
    for text in TEXTS:
        ids = our_tokenizer.encode(text)
        assert ids == hf_gguf_tokenizer.encode(text), text
        assert our_tokenizer.decode(ids) == text
        assert our_tokenizer.decode(ids, skip_special_tokens=True) == hf_gguf_tokenizer.decode(
            ids, skip_special_tokens=True)
    assert our_tokenizer.encode("<|im_start|>") == [1]  # control tokens stay whole
    assert (our_tokenizer.bos_token, our_tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_smollm_pre_tokenizer_isolates_every_number_char(our_tokenizer):
    """llama.cpp's `smollm` pre-tokenizer splits each \\p{N} char off before the GPT-2 regex.

    transformers' GGUF loader does not know `smollm` and keeps " ½" together (its ids differ
    there); we follow llama.cpp and SmolLM2's own tokenizer.json (Digits(individual_digits)).
    """
    pieces = our_tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x ½ 42")
    assert [p for p, _ in pieces] == ["x", "Ġ", "Â½", "Ġ", "4", "2"]  # byte-level spelling of ½


def test_chat_template_matches(our_tokenizer, hf_gguf_tokenizer):
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 12"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    for messages in (chat, chat[1:]):
        want = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert our_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want
        assert want.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("keep", [0, 1000, "garbage", "half"])
def test_truncated_gguf_raises_corrupt_and_leaves_nothing(smollm2_gguf, tmp_path, keep):
    data = smollm2_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    if keep == "garbage":
        bad.write_bytes(b"not a gguf file " * 100)
    else:
        bad.write_bytes(data[: len(data) // 2 if keep == "half" else keep])
    out = tmp_path / "out"
    with pytest.raises(CorruptFileError, match="bad.gguf.*[Dd]elete"):
        convert_gguf(bad, out, progress=False)
    assert os.listdir(tmp_path) == ["bad.gguf"]  # no out_dir, no temp folder beside it


# --- tiny synthetic GGUFs: one per supported architecture, plus an unsupported one -------------

def _write_tiny_gguf(path, arch, *, tied=True):
    rng = np.random.default_rng(0)
    vocab, hidden, ffn, heads, kv_heads, head_dim = 64, 32, 48, 4, 2, 16 if arch == "qwen3" else 8
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges(["a a", "aa a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def t(name, *shape):  # numpy (HF) shape; the writer stores GGUF's reversed dims itself
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    t("token_embd.weight", vocab, hidden)
    t("output_norm.weight", hidden)
    if not tied:
        t("output.weight", vocab, hidden)
    for i in range(2):
        t(f"blk.{i}.attn_norm.weight", hidden)
        t(f"blk.{i}.ffn_norm.weight", hidden)
        t(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        t(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        t(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        t(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        t(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        t(f"blk.{i}.ffn_up.weight", ffn, hidden)
        t(f"blk.{i}.ffn_down.weight", hidden, ffn)
        if arch == "qwen2":
            for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                t(f"blk.{i}.attn_{p}.bias", n * head_dim)
        if arch == "qwen3":
            t(f"blk.{i}.attn_q_norm.weight", head_dim)
            t(f"blk.{i}.attn_k_norm.weight", head_dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_tiny_gguf_per_arch_matches_transformers(tmp_path, arch, tied):
    """Naming (qkv bias), q/k un-permute and tying per family, on random F32 weights."""
    path = tmp_path / f"{arch}.gguf"
    _write_tiny_gguf(path, arch, tied=tied)
    out = convert_gguf(path, tmp_path / "out", progress=False)
    _assert_same_state_dict(out, path)
    assert transformers.AutoConfig.from_pretrained(out).tie_word_embeddings == tied


def test_tiny_qwen3_gguf_keeps_head_dim_and_qk_norms(tmp_path):
    """Qwen3's head_dim (16 here) is not hidden/heads (8), so it must come from key_length.

    transformers' GGUF loader drops key_length (it builds q_proj for head_dim 128), so it cannot
    be the oracle here: the F32 tensors we wrote are, since llama.cpp does not permute Qwen3.
    """
    path = tmp_path / "qwen3.gguf"
    _write_tiny_gguf(path, "qwen3", tied=False)
    out = convert_gguf(path, tmp_path / "out", progress=False)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or re-initialised
    assert model.config.head_dim == 16
    got = model.state_dict()
    for t in gguf.GGUFReader(path).tensors:
        name = t.name.replace("blk.", "model.layers.").replace("token_embd", "model.embed_tokens")
        for a, b in (("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                     ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                     ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                     ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                     ("ffn_down", "mlp.down_proj"), ("attn_norm", "input_layernorm"),
                     ("ffn_norm", "post_attention_layernorm"), ("output_norm", "model.norm"),
                     ("output.", "lm_head.")):
            name = name.replace(a, b)
        assert torch.equal(got[name], torch.from_numpy(t.data.reshape(got[name].shape).copy())), name


def test_unsupported_architecture_raises(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(path, "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"'mamba'.*llama.*qwen2.*qwen3"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_file_raises_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)


def test_a_bf16_load_converts_a_bf16_folder_with_the_values_a_float32_folder_gives(smollm2_gguf, tmp_path,
                                                                                  monkeypatch):
    """The default dtype's cache holds bf16 (half the bytes); its weights equal the float32
    folder's cast to bf16, bit for bit; a bf16 load reuses a float32 folder already there."""
    import graft_tk
    from graft_tk.models import resolve
    monkeypatch.setenv("GRAFT_TK_HOME", str(tmp_path))
    bf16 = graft_tk.load_model(smollm2_gguf, dtype="bf16", progress=False)
    fp32 = graft_tk.load_model(smollm2_gguf, dtype="fp32", progress=False)
    assert bf16.path.name.endswith("-bf16") and not fp32.path.name.endswith("-bf16")
    size = lambda p: sum(f.stat().st_size for f in p.glob("*.safetensors"))  # noqa: E731
    assert size(bf16.path) < 0.51 * size(fp32.path)
    cast = {k: v.to(torch.bfloat16) for k, v in fp32.net.named_parameters()}
    assert all(torch.equal(v, cast[k]) for k, v in bf16.net.named_parameters())
    shutil.rmtree(bf16.path)
    assert resolve(str(smollm2_gguf), progress=False, dtype=torch.bfloat16)[1] == fp32.path   # no new conversion
