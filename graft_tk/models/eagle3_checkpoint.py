"""EAGLE-3 head checkpoints: read and write the layouts the EAGLE-3 ecosystem publishes.

Checkpoints (``load_eagle3`` / ``save_eagle3``), as published by
  EAGLE (SafeAILab/EAGLE ``eagle/model/cnets.py``, ``eagle/traineagle3/``) and SpecForge
  (sgl-project/SpecForge ``specforge/modeling/draft/llama3_eagle.py``): a flat Llama config.json
  with ``draft_vocab_size`` (+ ``target_hidden_size``, ``eagle_config``), tensors ``fc.weight``,
  ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` in model.safetensors or pytorch_model.bin;
  vLLM speculators: ``transformer_layer_config`` nested, ``layers.0.`` instead of ``midlayer.``,
  ``norm_before_residual``, top-level ``eagle_aux_hidden_state_layer_ids``.
The embedding is usually not shipped (SpecForge drops every ``embed`` key when saving): the
target's table is used, which needs ``hidden_size == target hidden``. A shipped
``embed_tokens.weight`` is used instead, unless it equals the target's (EAGLE's own releases
ship the frozen copy): then the target's table is shared, not held twice.

Target layer ids: ours are 0-based decoder layers whose OUTPUT is taken (SpecForge and SGLang's
``eagle_config.eagle_aux_hidden_state_layer_ids``); default ``(1, L//2 - 1, L - 4)``, the
output-side twin of EAGLE's capture of the inputs of layers ``2, L//2, L - 3``. vLLM's top-level
``eagle_aux_hidden_state_layer_ids`` counts the embeddings as 0, so id j is our j - 1.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._fs import atomic_dir
from ..errors import CorruptFileError, InputError, ModelNotFoundError, UnsupportedModelError
from .checkpoint import _hf_tensors, config_from_hf
from .eagle3 import Eagle3Config, Eagle3Head, default_target_layers
from .transformer import ModelConfig, rope_inv_freq

if TYPE_CHECKING:
    from . import Model

log = logging.getLogger(__name__)

__all__ = ["Eagle3CheckpointError", "eagle3_config", "load_eagle3", "save_eagle3"]


class Eagle3CheckpointError(UnsupportedModelError):
    """An EAGLE-3 checkpoint that is incomplete, of an unknown layout, or built for another target."""


_LAYER = "midlayer."
_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator"}


def _published_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold, by its published (EAGLE / SpecForge) name."""
    lc, H, p = cfg.layer, cfg.hidden_size, _LAYER
    q, kv = lc.n_heads * lc.head_dim, lc.n_kv_heads * lc.head_dim
    return {
        "fc.weight": (H, cfg.fused_size),
        p + "input_layernorm.weight": (H,), p + "hidden_norm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (q, 2 * H), p + "self_attn.k_proj.weight": (kv, 2 * H),
        p + "self_attn.v_proj.weight": (kv, 2 * H), p + "self_attn.o_proj.weight": (H, q),
        p + "mlp.gate_proj.weight": (lc.intermediate_size, H), p + "mlp.up_proj.weight": (lc.intermediate_size, H),
        p + "mlp.down_proj.weight": (H, lc.intermediate_size),
        "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H),
    }


# ours <- published; a tuple = fused in this order along dim 0
_TO_OURS = {
    "fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
    "layer.embed_norm.weight": _LAYER + "input_layernorm.weight",
    "layer.hidden_norm.weight": _LAYER + "hidden_norm.weight",
    "layer.ffn_norm.weight": _LAYER + "post_attention_layernorm.weight",
    "layer.attention.wqkv.weight": tuple(_LAYER + f"self_attn.{x}_proj.weight" for x in "qkv"),
    "layer.attention.wo.weight": _LAYER + "self_attn.o_proj.weight",
    "layer.feed_forward.w13.weight": (_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight"),
    "layer.feed_forward.w2.weight": _LAYER + "mlp.down_proj.weight",
}


def _layer_ids(hf: dict, target: ModelConfig, source: Path) -> tuple[int, ...]:
    eagle_cfg = hf.get("eagle_config") or {}
    if eagle_cfg.get("use_aux_hidden_state") is False:
        raise Eagle3CheckpointError(f"{source}: eagle_config.use_aux_hidden_state is false (a head without "
                                    "fused target features); only EAGLE-3 heads are supported")
    if hf.get("eagle_aux_hidden_state_layer_ids"):            # vLLM: 0 = embeddings, j = output of layer j-1
        ids = tuple(int(j) - 1 for j in hf["eagle_aux_hidden_state_layer_ids"])
    elif eagle_cfg.get("eagle_aux_hidden_state_layer_ids"):   # SpecForge / SGLang: output of layer j
        ids = tuple(int(j) for j in eagle_cfg["eagle_aux_hidden_state_layer_ids"])
    else:
        ids = default_target_layers(target.n_layers)
    if not all(0 <= i < target.n_layers for i in ids):
        raise Eagle3CheckpointError(f"{source}: the head reads target layers {ids} (outputs, 0-based) but the "
                                    f"target has {target.n_layers} layers; is it a head for another target?")
    return ids


def eagle3_config(hf: dict, target: ModelConfig, source: Path) -> Eagle3Config:
    """Parse an EAGLE-3 config.json (EAGLE / SpecForge flat, or speculators nested) for ``target``."""
    hf = {**hf, **(hf.get("transformer_layer_config") or {})}   # speculators nests the layer's config
    archs = set(hf.get("architectures") or [])
    if ("draft_vocab_size" not in hf and hf.get("speculators_model_type") != "eagle3"
            and not archs & _ARCHITECTURES):
        raise Eagle3CheckpointError(
            f"{source}: config.json is not an EAGLE-3 head (no draft_vocab_size, architectures {sorted(archs)}); "
            "expected an EAGLE / SpecForge (LlamaForCausalLMEagle3) or speculators (eagle3) checkpoint")
    if hf.get("num_hidden_layers", 1) != 1:
        raise Eagle3CheckpointError(f"{source}: num_hidden_layers={hf['num_hidden_layers']}; only one-layer "
                                    "EAGLE-3 heads are supported")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                    ("norm_before_fc", False)):
        if hf.get(key, ok) not in (ok, None):
            raise Eagle3CheckpointError(f"{source}: {key}={hf[key]!r} is not supported (only {ok!r})")
    try:
        layer = config_from_hf({**hf, "model_type": "llama", "num_hidden_layers": 1,
                                "tie_word_embeddings": False}, source)
    except KeyError as e:
        raise Eagle3CheckpointError(f"{source}: config.json lacks {e}") from e
    except ValueError as e:
        raise Eagle3CheckpointError(f"{source}: {e}") from e
    if layer.vocab_size != target.vocab_size:
        raise Eagle3CheckpointError(f"{source}: vocabulary mismatch: the head was built for vocab_size="
                                    f"{layer.vocab_size}, the target has {target.vocab_size}; a head only "
                                    "works with the target (tokenizer) it was trained for")
    target_hidden = hf.get("target_hidden_size") or layer.dim
    if target_hidden != target.dim:
        raise Eagle3CheckpointError(f"{source}: hidden size mismatch: the head fuses target features of "
                                    f"hidden size {target_hidden}, the target's is {target.dim}")
    try:
        return Eagle3Config(layer, target_hidden, hf.get("draft_vocab_size") or layer.vocab_size,
                            _layer_ids(hf, target, source), bool(hf.get("norm_before_residual", False)))
    except ValueError as e:
        raise Eagle3CheckpointError(f"{source}: {e}") from e


def _read_tensors(path: Path) -> dict[str, Tensor]:
    if any(path.glob("*.safetensors")):
        tensors = dict(_hf_tensors(path))
    elif (path / "pytorch_model.bin").is_file():
        f = path / "pytorch_model.bin"
        try:
            tensors = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types for a bad pickle
            raise CorruptFileError(f"{f} cannot be read ({e}); fetch it again") from e
    else:
        raise Eagle3CheckpointError(f"{path} has neither *.safetensors nor pytorch_model.bin")
    # speculators / vLLM name the layer layers.0.
    return {(_LAYER + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}


def load_eagle3(path: str | Path, target: Model, dtype: torch.dtype | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head for ``target`` (on its device; dtype default the target's).

    Raises Eagle3CheckpointError when the checkpoint is incomplete, of an unknown layout, or built
    for another target (hidden size, vocabulary, layer count).
    """
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} is not an EAGLE-3 checkpoint folder (no config.json)")
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{path / 'config.json'} cannot be read ({e})") from e
    cfg = eagle3_config(hf, target.config, path)
    tensors = _read_tensors(path)
    shapes = _published_shapes(cfg)
    optional = {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "d2t": (cfg.draft_vocab_size,),
                "t2d": (cfg.vocab_size,)}
    unexpected = sorted(k for k in tensors if k not in shapes and k not in optional
                        and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise Eagle3CheckpointError(f"{path}: unexpected tensors {unexpected[:5]}; not a one-layer EAGLE-3 head")
    missing = [k for k in shapes if k not in tensors]
    if missing:
        raise Eagle3CheckpointError(f"{path}: missing tensors {missing} (EAGLE-3 / SpecForge names)")
    if tuple(tensors["fc.weight"].shape) != shapes["fc.weight"]:
        raise Eagle3CheckpointError(
            f"{path}: hidden size mismatch: fc.weight is {list(tensors['fc.weight'].shape)}, the head needs "
            f"{list(shapes['fc.weight'])} ({len(cfg.target_layers)} target layers x hidden {target.config.dim})")
    for name, want in {**shapes, **optional}.items():
        if name in tensors and tuple(tensors[name].shape) != want:
            raise Eagle3CheckpointError(f"{path}: {name} is {list(tensors[name].shape)}, expected {list(want)}")
    if "d2t" not in tensors and cfg.draft_vocab_size != cfg.vocab_size:
        raise Eagle3CheckpointError(f"{path}: missing tensors ['d2t'] (needed when draft_vocab_size "
                                    f"{cfg.draft_vocab_size} < vocab_size {cfg.vocab_size})")
    if "embed_tokens.weight" not in tensors and cfg.hidden_size != target.config.dim:
        raise Eagle3CheckpointError(f"{path}: missing tensors ['embed_tokens.weight']: the head's hidden size "
                                    f"{cfg.hidden_size} differs from the target's {target.config.dim}")

    device, dtype = target.device, dtype or target.dtype
    shipped, target_emb = tensors.get("embed_tokens.weight"), target.net.tok_embeddings.weight
    if shipped is not None and shipped.shape == target_emb.shape and torch.equal(shipped.to(target_emb), target_emb):
        del tensors["embed_tokens.weight"]   # EAGLE ships a frozen copy of the target's table: share it
    own_embedding = "embed_tokens.weight" in tensors
    with torch.device("meta"):
        head = Eagle3Head(cfg, None if own_embedding else torch.empty(cfg.vocab_size, cfg.hidden_size))
    state = {ours: torch.cat([tensors[n] for n in src]) if isinstance(src, tuple) else tensors[src]
             for ours, src in _TO_OURS.items()}
    if own_embedding:
        state["tok_embeddings.weight"] = tensors["embed_tokens.weight"]
    head.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    # Buffers built on meta are rebuilt on the real device.
    head.inv_freq = rope_inv_freq(cfg.layer).to(device)
    if not own_embedding:
        head._shared_embedding = target_emb.detach()
    head.draft_ids = torch.arange(cfg.draft_vocab_size, device=device)
    head.d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=device)
    try:
        head.set_vocab_map(tensors.get("d2t", head.d2t))
    except InputError as e:
        raise Eagle3CheckpointError(f"{path}: {e}") from e
    if "t2d" in tensors and not torch.equal(tensors["t2d"].bool().to(device), head.t2d):
        raise Eagle3CheckpointError(f"{path}: t2d does not mark exactly the target ids that d2t maps to")
    head.name, head.path = f"eagle3:{path.name}", path
    log.info("loaded EAGLE-3 head %s (hidden %d, draft vocab %d, target layers %s)", path, cfg.hidden_size,
             cfg.draft_vocab_size, cfg.target_layers)
    return head.eval().requires_grad_(False)


def save_eagle3(head: Eagle3Head, path: str | Path, extra_files: dict[str, bytes] | None = None) -> None:
    """Write ``head`` as an EAGLE / SpecForge checkpoint folder (config.json + model.safetensors),
    atomically: ``path`` is replaced as a whole, ``extra_files`` (name -> bytes) included. A shared
    (target) embedding is not written."""
    from safetensors.torch import save_file

    cfg, lc = head.config, head.config.layer
    state = head.state_dict()
    tensors: dict[str, Tensor] = {}
    for ours, src in _TO_OURS.items():
        parts = (src,) if isinstance(src, str) else src
        sizes = [_published_shapes(cfg)[n][0] for n in parts]
        for name, t in zip(parts, state[ours].split(sizes)):
            tensors[name] = t
    if head.tok_embeddings is not None:
        tensors["embed_tokens.weight"] = state["tok_embeddings.weight"]
    tensors["d2t"], tensors["t2d"] = head.d2t, head.t2d
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    rope = None if lc.rope_scaling is None else {"rope_type": "llama3", **dict(lc.rope_scaling)}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": lc.dim, "intermediate_size": lc.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": lc.n_heads, "num_key_value_heads": lc.n_kv_heads, "head_dim": lc.head_dim,
        "rms_norm_eps": lc.rms_norm_eps, "rope_theta": lc.rope_theta, "rope_scaling": rope,
        "max_position_embeddings": lc.max_position_embeddings, "vocab_size": lc.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False, "norm_before_residual": cfg.norm_before_residual,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.target_layers), "use_aux_hidden_state": True},
        "torch_dtype": str(head.lm_head.weight.dtype).removeprefix("torch."),
    }
    with atomic_dir(Path(path).expanduser()) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
