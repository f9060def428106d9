"""Load a Hugging Face checkpoint folder (config.json + *.safetensors) into our Transformer."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CorruptFileError, InputError, UnsupportedModelError
from .transformer import ModelConfig, Transformer, rope_inv_freq

log = logging.getLogger(__name__)

# HF `architectures[0]` / `model_type` -> our family switch.
_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}


_REQUIRED = ("num_hidden_layers", "num_attention_heads", "vocab_size", "hidden_size", "intermediate_size")


def config_from_hf(hf: dict, source: Path, num_layers: int | None = None) -> ModelConfig:
    if not isinstance(hf, dict):
        raise CorruptFileError(f"{source}/config.json holds a JSON {type(hf).__name__}, not an object; restore it")
    model_type = hf.get("model_type", "")
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; graft_tk runs "
            f"{sorted(_FAMILIES)} checkpoints (Llama, Qwen2, Qwen3 families)")
    missing = [k for k in _REQUIRED if not isinstance(hf.get(k), int) or hf[k] < 1]
    if missing:
        raise CorruptFileError(f"{source}/config.json lacks a positive integer {', '.join(missing)}; restore the "
                               "checkpoint's config.json")
    n_layers = hf["num_hidden_layers"]
    if num_layers is not None:
        if not 1 <= num_layers <= n_layers:
            raise InputError(f"num_layers={num_layers} but {source} has {n_layers} layers; "
                                        f"pick 1..{n_layers}")
        n_layers = num_layers
    # transformers < 5 writes rope_theta + rope_scaling; >= 5 writes one rope_parameters dict.
    rope = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {}),
            **(hf.get("rope_parameters") or {})}
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    rope_theta = float(rope.pop("rope_theta"))
    if kind == "default":
        scaling = None
    elif kind == "llama3":
        scaling = tuple(sorted((k, float(v)) for k, v in rope.items()))
    else:
        raise UnsupportedModelError(f"{source}: RoPE type {kind!r} is not supported (default and llama3 are)")
    eos = hf.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    n_heads = hf["num_attention_heads"]
    return ModelConfig(
        arch=_FAMILIES[model_type],
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        intermediate_size=hf["intermediate_size"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
    )


def read_config(path: Path, num_layers: int | None = None) -> ModelConfig:
    cfg_file = path / "config.json"
    try:
        hf = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{cfg_file} cannot be read ({e}); restore or re-create the checkpoint") from e
    return config_from_hf(hf, path, num_layers)


def _hf_tensors(path: Path):
    """Yield (hf_name, tensor) from every *.safetensors file in the folder (sharded or not)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path} has no *.safetensors files; convert .bin checkpoints "
                                    "to safetensors first")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CorruptFileError(f"{f} is truncated or corrupt ({e}); delete it and fetch it again") from e


def _to_ours(name: str, n_layers: int) -> tuple[str, int | None, str | None] | None:
    """Map an HF tensor name to (our name, layer, fused slot) or None to skip it."""
    if name == "model.embed_tokens.weight":
        return "tok_embeddings.weight", None, None
    if name == "model.norm.weight":
        return "norm.weight", None, None
    if name == "lm_head.weight":
        return "output.weight", None, None
    if not name.startswith("model.layers."):
        return None
    _, _, idx, rest = name.split(".", 3)
    layer = int(idx)
    if layer >= n_layers:
        return None
    p = f"layers.{layer}."
    simple = {
        "input_layernorm.weight": "attention_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "attention.wo.weight",
        "self_attn.q_norm.weight": "attention.q_norm.weight",
        "self_attn.k_norm.weight": "attention.k_norm.weight",
        "mlp.down_proj.weight": "feed_forward.w2.weight",
    }
    if rest in simple:
        return p + simple[rest], None, None
    for proj in ("q", "k", "v"):
        for kind in ("weight", "bias"):
            if rest == f"self_attn.{proj}_proj.{kind}":
                return p + f"attention.wqkv.{kind}", layer, proj
    for proj in ("gate", "up"):
        if rest == f"mlp.{proj}_proj.weight":
            return p + "feed_forward.w13.weight", layer, proj
    return None


_FUSE_ORDER = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}


_QUANT_PARTS = ("qweight", "scales", "zeros")


def quant_of(path: Path) -> str:
    """The quantization a checkpoint folder holds: "none", or "int8" / "int4" (its ``quant.json``)."""
    f = path / "quant.json"
    if not f.exists():
        return "none"
    try:
        return json.loads(f.read_text())["quant"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise CorruptFileError(f"{f} cannot be read ({e}); delete {path} to convert the model again") from e


def load_transformer(path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                     quant: str = "none") -> Transformer:
    """Build the model on the meta device and fill it from the checkpoint's tensors. A quantized
    folder (``quant.json``) gives QuantLinear layers; ``quant`` on a float folder quantizes them
    after loading (``quantize_model``)."""
    from . import cpu_paths
    from .quant import QuantLinear, quantize_model

    with torch.device("meta"):
        net = Transformer(cfg)
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for hf_name, t in _hf_tensors(path):
        base, _, suffix = hf_name.rpartition(".")
        if suffix in _QUANT_PARTS:      # a quantized weight's part: integers as stored, scales kept fp32 here
            hf_name = base + ".weight"
        else:
            suffix, t = "", t.to(dtype=dtype)
        mapped = _to_ours(hf_name, cfg.n_layers)
        if mapped is None:
            continue
        name, _, slot = mapped
        if suffix:
            name = name.removesuffix("weight") + suffix
        t = t.to(device=device)
        if slot is None:
            state[name] = t
        else:
            parts.setdefault(name, {})[slot] = t
    for name, pieces in parts.items():
        state[name] = torch.cat([pieces[s] for s in sorted(pieces, key=_FUSE_ORDER.__getitem__)], dim=0)
    for name in [n.removesuffix(".qweight") for n in state if n.endswith(".qweight")]:
        parent, _, attr = name.rpartition(".")
        layer = QuantLinear(state.pop(name + ".qweight"), state.pop(name + ".scales"), state.pop(name + ".zeros", None),
                            state.pop(name + ".bias", None), dtype)
        setattr(net.get_submodule(parent) if parent else net, attr, layer)
    if cfg.tie_word_embeddings and not isinstance(net.output, QuantLinear):
        state.pop("output.weight", None)
    expected = {n for n, _ in net.named_parameters()}
    missing = expected - set(state)
    if missing:
        raise UnsupportedModelError(f"{path} lacks {len(missing)} tensors the {cfg.arch} architecture needs, "
                                    f"e.g. {sorted(missing)[:3]}; is it a complete {cfg.arch} checkpoint?")
    unexpected = set(state) - expected
    if unexpected:
        raise UnsupportedModelError(f"{path} has tensors the {cfg.arch} architecture does not use, "
                                    f"e.g. {sorted(unexpected)[:3]}")
    net.load_state_dict(state, assign=True, strict=False)
    # Buffers built on meta (RoPE frequencies) are recomputed on the real device.
    net.inv_freq = rope_inv_freq(cfg).to(device)
    if quant != "none" and quant_of(path) == "none":
        quantize_model(net, quant)
    cpu_paths.apply(net)          # each CPU layer's path per call width (graft-autotune's picks)
    return net.eval().requires_grad_(False)
