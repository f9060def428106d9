"""What every command line shares: which drafter pairs with a model, loading one from a spec, the
quantization flags, number arguments with a lower bound."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import InputError
from ..models import QUANTS, Model, load_model
from ..models.eagle3 import Eagle3Head
from ..models.eagle3_checkpoint import load_eagle3
from ..models.quant import cpu_drafter_quant
from ..models.registry import HF_ALIASES, HF_DRAFTERS, REGISTRY, fetch_gguf


def default_drafter(model: str) -> str | None:
    """The drafter that pairs with ``model`` (registry models, and HF aliases like qwen3), or None."""
    entry = REGISTRY.get(model)
    if entry is not None:
        return entry.drafter
    return HF_DRAFTERS.get(HF_ALIASES.get(model, model))


def load_drafter(spec: str | None, target: Model, model: str, dtype=None, device=None,
                 quant: str = "none") -> Model | Eagle3Head | None:
    """``None`` / ``"none"`` -> no drafter; ``"self:L"`` -> the target's first L layers (``model`` is
    the target's name as given); ``"eagle3:PATH"`` -> an EAGLE-3 head for ``target``; else load_model(spec).
    ``quant``: the drafter model's quantization (an EAGLE-3 head stays float)."""
    if spec is None or spec == "none":
        return None
    if spec.startswith("self:"):
        layers = spec[5:]
        if not layers.isdigit() or int(layers) < 1:
            raise InputError(f"--drafter self:L needs a layer count L >= 1, got {spec!r}")
        return load_model(model, dtype=dtype, device=device, num_layers=int(layers), quant=quant)
    if spec.startswith("eagle3:"):
        return load_eagle3(spec[len("eagle3:"):], target)
    return load_model(spec, dtype=dtype, device=device, quant=quant)


def add_quant_args(p, drafter: bool = True) -> None:
    """A CLI's ``--quant`` (and with ``drafter``, ``--drafter-quant``; read it with ``drafter_quant``)."""
    p.add_argument("--quant", default="none", choices=QUANTS,
                   help="quantization of the target's linear layers: int8 / int4 weight-only, a8w8 = int8 weights "
                        "and int8 activations (a CPU; lossless with --exact) (default: %(default)s; with any of them "
                        "use --dtype bf16 on a CPU)")
    if drafter:
        p.add_argument("--drafter-quant", default=None, choices=QUANTS,
                       help="the drafter's quantization (default: int4-all for a bf16/fp16 target on a CPU "
                            "-- the drafter only proposes, so its bits cost acceptance, never output -- else --quant's)")


def drafter_quant(args, target: Model) -> str:
    """The drafter's quantization from a CLI's ``--drafter-quant``. Default: ``cpu_drafter_quant``
    (int4-all on a CPU in bf16 / fp16), else ``--quant``."""
    return args.drafter_quant or cpu_drafter_quant(target.device, target.dtype) or args.quant


def gguf_source(model: str) -> Path | None:
    """The GGUF file a ``--model`` argument names (a built-in model's verified file, or a .gguf
    path), else None: what the llama.cpp anchors run."""
    if model in REGISTRY:
        return fetch_gguf(REGISTRY[model], progress=False)
    return Path(model).expanduser() if model.endswith(".gguf") else None


def drafter_spec(args) -> str | None:
    """A CLI's drafter: ``--eagle3 PATH`` or ``--drafter SPEC``, else the registry's pair for ``--model``."""
    if args.eagle3 is not None:
        if args.drafter is not None:
            raise InputError("pass --drafter or --eagle3, not both")
        return f"eagle3:{args.eagle3}"
    return args.drafter if args.drafter is not None else default_drafter(args.model)


def at_least(low: float, kind: type = int):
    """An argparse ``type``: a ``kind`` number >= ``low`` (argparse names the flag in its error)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {text}")
        return value
    parse.__name__ = kind.__name__       # argparse's "invalid <name> value" message
    return parse
