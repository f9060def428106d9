"""Convert a GGUF file into a Hugging-Face-style checkpoint folder.

GGUF (llama.cpp's format) stores quantised weights under llama.cpp's tensor names and the config
and tokenizer as metadata. Everything else in graft_tk (and transformers, our test oracle) reads HF
folders, so we convert once: dequantise every tensor to float32, rename it, undo llama.cpp's
layout changes, and rebuild config.json / tokenizer.json / tokenizer_config.json from the metadata.

    convert_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), Path("~/.cache/graft_tk/smollm2"))
"""
from __future__ import annotations

import json
import logging
import re
import struct
import sys
from pathlib import Path

import numpy as np
import torch

from graft_tk._fs import atomic_dir
from graft_tk.errors import CorruptFileError, ModelNotFoundError, UnsupportedModelError

log = logging.getLogger(__name__)

# GGUF architecture -> (HF class, HF model_type).
ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# llama.cpp's per-layer tensor names -> HF's (the ".weight"/".bias" suffix is carried over).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp applies them.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True, quant: str = "none",
                 dtype: torch.dtype = torch.float32) -> Path:
    """Write an HF checkpoint folder for ``gguf_path`` at ``out_dir`` and return ``out_dir``.

    The folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
    generation_config.json) appears atomically: on any error no ``out_dir`` is left behind.
    ``quant="none"``: every tensor in ``dtype`` (float32, or bfloat16: the values a float32
    folder gives once a bf16 load casts them, in half the bytes). ``"int8"`` / ``"int4"``: the linear layers
    quantized from their GGUF blocks (``_linear_formats``) and a ``quant.json`` saying which format
    each got; the embedding in fp16, norms and biases in fp32; no float32 copy of a linear layer
    is ever written. Raises UnsupportedModelError for an architecture or tokenizer we cannot
    convert, and CorruptFileError for a truncated or unreadable file.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf_path} does not exist.")
    reader = _open(gguf_path)
    meta = _Meta(reader, gguf_path)
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise UnsupportedModelError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(ARCHS))}."
        )
    config = _config(meta, arch, {t.name for t in reader.tensors})
    plan = _plan_tensors(reader, gguf_path, arch, config)  # validates names before anything is written
    tok_json, tok_config = _tokenizer(meta, gguf_path)
    gen_config = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}

    log.info("converting %s (%s, %d tensors) to %s", gguf_path, arch, len(plan), out_dir)
    with atomic_dir(out_dir) as tmp:
        if quant == "none":
            _write_safetensors(tmp / "model.safetensors", plan, gguf_path, progress, dtype)
        else:
            formats = _write_quantized(tmp / "model.safetensors", plan, gguf_path, progress, quant)
            (tmp / "quant.json").write_text(json.dumps({"quant": quant, "group": 32, "formats": formats}, indent=1))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(gen_config, indent=2))
        (tmp / "tokenizer.json").write_text(tok_json, encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    log.info("wrote %s", out_dir)
    return out_dir


def _corrupt(path: Path, why: str) -> CorruptFileError:
    return CorruptFileError(
        f"{path} is corrupt or truncated ({why}). Delete it and fetch it again."
    )


def _open(path: Path):
    import gguf

    try:
        # GGUFReader parses the header, metadata and tensor index eagerly and memory-maps the data;
        # a truncated file fails here with assorted errors (ValueError, IndexError, struct.error...).
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise _corrupt(path, f"{type(e).__name__}: {e}") from e


class _Meta:
    """Typed access to the metadata key/values of a GGUF reader."""

    def __init__(self, reader, path: Path):
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise UnsupportedModelError(f"{self.path}: GGUF metadata lacks {key!r}; cannot build a config.")
        return value


def _config(meta: _Meta, arch: str, tensor_names: set[str]) -> dict:
    key = lambda name: meta.need(f"{arch}.{name}")  # noqa: E731
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        # We do not translate rope scaling; converting without it would silently change the model.
        raise UnsupportedModelError(f"{meta.path}: rope scaling {scaling!r} is not supported.")
    cls, model_type = ARCHS[arch]
    config = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": meta.get(f"{arch}.vocab_size") or len(meta.need("tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        # Qwen3 states key_length (its head_dim is not hidden/heads); older files leave it implied.
        "head_dim": meta.get(f"{arch}.attention.key_length") or hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length"),
        # llama.cpp writes output.weight only when the head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
        "attention_bias": arch == "qwen2",  # Qwen2 has q/k/v biases, Llama/Qwen3 none
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    for name in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(token_id)
    return config


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Llama q/k projection (weight or bias).

    HF's Llama rotates the two halves of each head (rotate_half); llama.cpp's kernel rotates
    adjacent pairs, so convert_hf_to_gguf.py reorders each head's rows as
    ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)`` (row i of half h -> row 2 * i + h).
    The inverse reads each head's rows as (d // 2, 2) pairs and swaps back.
    """
    rows = w.shape[0]
    head = rows // n_head
    return w.reshape(n_head, head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _plan_tensors(reader, path: Path, arch: str, config: dict) -> list[tuple[str, object, tuple, int | None]]:
    """(HF name, GGUF tensor, HF shape, heads to un-permute by or None) for every tensor."""
    plan = []
    for t in reader.tensors:
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
            if not m or m.group(2) not in _LAYER_NAMES:
                raise UnsupportedModelError(f"{path}: tensor {t.name!r} has no HF counterpart we know.")
            name = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
        heads = None
        if arch == "llama" and ".attn_q." in t.name:
            heads = config["num_attention_heads"]
        elif arch == "llama" and ".attn_k." in t.name:
            heads = config["num_key_value_heads"]
        # GGUF lists dimensions fastest-first, the reverse of numpy/torch order.
        shape = tuple(int(d) for d in reversed(t.shape))
        plan.append((name, t, shape, heads))
    return plan


def _write_safetensors(dest: Path, plan, path: Path, progress: bool, dtype: torch.dtype = torch.float32) -> None:
    """Stream float32 (or bfloat16) tensors into a safetensors file, one tensor in memory at a time.

    safetensors' own writers need every tensor in memory at once (6 GB for a 1.5B model in
    float32); the format is simple enough to write directly: an 8-byte little-endian header
    length, a JSON header of dtype/shape/byte offsets, then the raw tensor bytes in order.
    """
    from tqdm import tqdm

    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"a converted folder holds float32 or bfloat16, not {dtype}")
    width, tag = (4, "F32") if dtype == torch.float32 else (2, "BF16")
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, _, shape, _ in plan:
        size = width * int(np.prod(shape))
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the tensor data 8-byte aligned, as safetensors does

    with open(dest, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, t, shape, heads in tqdm(plan, desc="dequantising", unit="tensor",
                                          disable=not progress, file=sys.stderr):
            values = _dequantized(t, shape, heads, path).astype("<f4", copy=False)
            if dtype == torch.bfloat16:      # round to nearest even, as a load's .to(bfloat16) does
                values = torch.tensor(values).to(torch.bfloat16).view(torch.int16).numpy()
            f.write(values.tobytes())


_FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K"}
# HF linear weights that are fused into one matmul (Transformer's wqkv and w13): one format for all.
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _linear_formats(plan, quant: str) -> dict[str, str]:
    """HF linear weight name -> "int4" / "int8". int8 quantizes everything per output channel. int4
    keeps 4-bit tensors (Q4_0, Q4_1, Q4_K: groups of 32) 4-bit and gives those stored finer in the
    GGUF (Q5_x, Q6_K, Q8_0, F16, F32) int8 per output channel, the nearest format that does not
    lose their extra bits; a fused matmul takes the finer format of its parts. int4-all makes every
    one int4 (re-quantizing the finer ones: a drafter's format, see ``quant.QUANTS``). A tied LM head
    (no ``lm_head.weight``) is made from the embedding and named ``lm_head.weight`` here."""
    linear = {name: (t.tensor_type.name, shape) for name, t, shape, _ in plan
              if name.endswith("_proj.weight") or name == "lm_head.weight"}
    if "lm_head.weight" not in linear:
        linear["lm_head.weight"] = next((t.tensor_type.name, shape) for name, t, shape, _ in plan
                                        if name == "model.embed_tokens.weight")
    if quant == "int8":
        return dict.fromkeys(linear, "int8")
    if quant == "int4-all":    # int8 only where the input width does not split into groups
        return {name: "int4" if shape[-1] % 32 == 0 else "int8" for name, (_, shape) in linear.items()}
    four_bit: dict[str, bool] = {}                      # matmul -> all its parts are 4-bit
    for name, (kind, _) in linear.items():
        four_bit[_matmul_of(name)] = four_bit.get(_matmul_of(name), True) and kind in _FOUR_BIT
    return {name: "int4" if four_bit[_matmul_of(name)] else "int8" for name in linear}


def _matmul_of(name: str) -> str:
    """The matmul an HF linear weight ends up in: a layer's q/k/v share one (``...layers.3.qkv``),
    its gate/up one, every other weight its own (its name)."""
    parts = name.split(".")
    return ".".join(parts[:-3] + [_FUSED[parts[-2]]]) if len(parts) > 3 and parts[-2] in _FUSED else name


def _write_quantized(dest: Path, plan, path: Path, progress: bool, quant: str) -> dict[str, str]:
    """Quantize the linear layers tensor by tensor (``_linear_formats``) into a safetensors file
    of ``NAME.qweight`` / ``NAME.scales`` / ``NAME.zeros`` (NAME = the HF weight name without
    ``.weight``); other tensors float (the embedding fp16). Returns the formats."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .quant import quantize_int4, quantize_int8

    formats = _linear_formats(plan, quant)
    tied = not any(name == "lm_head.weight" for name, *_ in plan)
    out: dict[str, torch.Tensor] = {}
    for name, t, shape, heads in tqdm(plan, desc=f"quantizing ({quant})", unit="tensor", disable=not progress,
                                      file=sys.stderr):
        w = torch.tensor(_dequantized(t, shape, heads, path))  # a copy: F32 tensors are read-only memmap views
        targets = [name] if name in formats else []
        if name == "model.embed_tokens.weight":
            out[name] = w.half()
            targets = ["lm_head.weight"] if tied else []
        elif name not in formats:
            out[name] = w
        for target in targets:
            base = target.removesuffix(".weight")
            if formats[target] == "int4":
                out[base + ".qweight"], out[base + ".scales"], out[base + ".zeros"] = quantize_int4(w)
            else:
                out[base + ".qweight"], out[base + ".scales"] = quantize_int8(w)
    save_file(out, str(dest), metadata={"format": "pt", "graft_tk_quant": quant})
    return formats


def _dequantized(t, shape, heads, path: Path) -> np.ndarray:
    """One GGUF tensor as float32 in HF layout."""
    from gguf.quants import dequantize

    if t.data.nbytes != t.n_bytes:  # memmap slice cut short by a truncated file
        raise _corrupt(path, f"tensor {t.name} has {t.data.nbytes} of {t.n_bytes} bytes")
    try:
        w = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise UnsupportedModelError(f"{path}: {t.name}: {e}") from e
    w = np.ascontiguousarray(w.astype(np.float32, copy=False).reshape(shape))
    return np.ascontiguousarray(_unpermute(w, heads)) if heads is not None else w


def _tokenizer(meta: _Meta, path: Path) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config dict) for a byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pt
    from tokenizers import processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{path}: tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is."
        )
    tokens = meta.need("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.need("tokenizer.ggml.merges")]
    # Byte-level BPE vocabularies are stored already spelled in the byte alphabet; added tokens
    # are stored raw and matched whole before BPE, so the vocabulary can be used as is.
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))

    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        tok.normalizer = normalizers.NFC()  # Qwen2's own tokenizer.json normalises to NFC
        split = _QWEN2_SPLIT
    elif pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe"):
        split = _LLAMA3_SPLIT
    elif pre in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp first isolates every \p{N} (each digit its own piece), then the GPT-2 regex.
        split = None
        tok.pre_tokenizer = pt.Sequence([pt.Split(Regex(r"\p{N}"), behavior="isolated"),
                                         pt.Split(Regex(_GPT2_SPLIT), behavior="isolated"), byte_level])
    elif pre in ("gpt-2", "gpt2", "default"):
        split = _GPT2_SPLIT
    else:
        raise UnsupportedModelError(f"{path}: pre-tokenizer {pre!r} is not supported.")
    if split is not None:
        tok.pre_tokenizer = pt.Sequence([pt.Split(Regex(split), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>...) are special; user-defined ones (<tool_call>) are matched
    # whole but decoded like text. Neither is normalised, as llama.cpp matches them verbatim.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])

    def token(name: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        return None if token_id is None else tokens[token_id]

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos) or (add_eos and eos):
        # A generic fast tokenizer adds BOS/EOS only through the post-processor.
        pre_ids, post_ids = ([bos] if add_bos and bos else []), ([eos] if add_eos and eos else [])
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(pre_ids + ["$A"] + post_ids),
            pair=" ".join(pre_ids + ["$A"] + post_ids + pre_ids + ["$B:1"] + post_ids),
            special_tokens=[(t, tokens.index(t)) for t in {*pre_ids, *post_ids}],
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get(f"{meta.get('general.architecture')}.context_length"),
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tok.to_str(), config
