"""``load_model``: a registry name, a checkpoint folder, a .gguf file or a cached HF repo id -> Model."""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .._fs import exclusive, graft_home
from ..errors import CorruptFileError, InputError, ModelNotFoundError
from . import registry
from .checkpoint import load_transformer, quant_of, read_config
from .quant import QUANTS, check_quant, use_int8_activations
from .tokenizer import Tokenizer
from .transformer import ModelConfig, Transformer

log = logging.getLogger(__name__)

__all__ = ["Model", "ModelConfig", "Transformer", "Tokenizer", "load_model", "parse_dtype", "QUANTS"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


@dataclass(eq=False)
class Model:
    """A loaded model: the network, its config and tokenizer, and where it came from."""
    name: str
    path: Path          # the checkpoint folder the weights were read from
    config: ModelConfig
    tokenizer: Tokenizer
    net: Transformer
    quant: str = "none"     # "none", "int8", "int4", "int4-all" or "a8w8" (graft_tk.models.quant)

    @property
    def device(self) -> torch.device:
        return self.net.compute_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.compute_weight.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def __repr__(self) -> str:
        c = self.config
        quant = "" if self.quant == "none" else f", {self.quant}"
        return (f"Model({self.name!r}, {c.arch}, {c.n_layers} layers, dim {c.dim}, "
                f"{self.dtype}{quant}, {self.device})")


def parse_dtype(dtype) -> torch.dtype:
    if dtype is None:
        # bf16 is the fast path on GPUs and on CPUs with AVX-512 BF16 / AMX; pass "fp32" for exactness checks.
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def parse_device(device) -> torch.device:
    """``device`` (None: cuda when available, else cpu) as a torch device this process can use."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {device!r} was asked for but this torch sees no CUDA GPU "
                             f"(torch {torch.__version__}); use --device cpu, or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                             f"numbered from 0")
    elif dev.type != "cpu":
        raise InputError(f"device {device!r} is not supported; use cpu or cuda")
    return dev


def load_model(name_or_path: str | Path, *, dtype=None, device=None, num_layers: int | None = None,
               quant: str = "none", progress: bool = True) -> Model:
    """Load a model for decoding.

    name_or_path: a built-in name (``smollm2-135m``, ``qwen2.5-coder-1.5b``, ``qwen2.5-coder-0.5b``),
        a checkpoint folder (config.json + tokenizer.json + *.safetensors), a ``.gguf`` file, or a
        Hugging Face repo id / alias (``qwen3``) already in the local HF cache.
    dtype: torch dtype or "fp32" / "bf16" / "fp16"; default bf16.
    device: default "cuda" when available, else "cpu".
    num_layers: keep only the first L decoder layers (+ final norm and head) — a self-drafter.
    quant: "none" | "int8" | "int4" | "int4-all": weight-only quantized linear layers
        (``graft_tk.models.quant``; int4-all re-quantizes what a GGUF stores finer, for drafters);
        "a8w8" (CPU): the int8 weights, activations rounded to int8 per row (exact with exact=True);
        a GGUF model is quantized from its blocks once into its own cache folder, others on load.
        dtype is then the compute dtype (activations, scales, KV cache); on a CPU use bf16: torch's
        packed kernels are fast for bf16 activations and slow for fp32 ones.
    """
    if num_layers is not None and num_layers < 1:
        raise InputError(f"num_layers must be >= 1, got {num_layers}")
    quant = check_quant(quant)
    if quant == "a8w8" and str(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu") != "cpu":
        raise InputError(f"quant='a8w8' runs on a CPU (torch._int_mm's CPU kernel), not on {device or 'cuda'}; "
                         "pass device='cpu', or use quant='int8' or 'int4'")
    device = parse_device(device)
    stored = "int8" if quant == "a8w8" else quant        # a8w8 multiplies the int8 folder's weights
    t0 = time.perf_counter()
    name, path = resolve(str(name_or_path), progress, stored, parse_dtype(dtype))
    held = quant_of(path)
    if held != "none" and stored not in ("none", held):
        raise InputError(f"{path} holds {held} weights; load it with quant={held!r} (or its float source with {quant!r})")
    stored = held if held != "none" else stored
    cfg = read_config(path, num_layers)
    tokenizer = Tokenizer(path)
    try:
        net = load_transformer(path, cfg, parse_dtype(dtype), device, stored)
    except CorruptFileError as e:
        if not (path / registry.STAMP).exists():
            raise
        damaged = registry.verify_stamp(path)          # graft_tk converted it: say which file broke since
        raise CorruptFileError(f"{e}; {path} was converted by graft_tk and " + (
            "; ".join(damaged) if damaged else "every file still has its converted sha256") +
            f". Delete {path} and load it again: it is converted again from its verified source") from e
    if quant == "a8w8":
        use_int8_activations(net)
    else:
        quant = stored
    if num_layers is not None:
        name = f"{name}[:{num_layers}]"
    log.info("loaded %s (%s) from %s in %.1fs", name, quant, path, time.perf_counter() - t0)
    return Model(name=name, path=path, config=cfg, tokenizer=tokenizer, net=net, quant=quant)


def resolve(name: str, progress: bool = True, quant: str = "none", dtype: torch.dtype = torch.float32
            ) -> tuple[str, Path]:
    """(display name, checkpoint folder) for anything ``load_model`` accepts; a GGUF source with
    ``quant`` gets its quantized folder, else the float folder ``dtype`` reads (``_float_dirs``)."""
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFoundError(f"{p} is a folder without config.json; pass a Hugging Face checkpoint "
                                     "folder (config.json, tokenizer.json, *.safetensors) or a .gguf file")
        return p.name, p
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelNotFoundError(f"GGUF file {p} does not exist; check the path")
        # Keyed by path, size and mtime: a changed file gets a fresh conversion without re-hashing.
        st = p.stat()
        key = hashlib.sha1(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        return p.stem, _converted(lambda: p, _float_dirs(f"gguf-{p.stem}-{key}", quant, dtype), key, progress, quant)
    if name in registry.REGISTRY:
        entry = registry.REGISTRY[name]
        return name, _converted(lambda: registry.fetch_gguf(entry, progress), _float_dirs(name, quant, dtype),
                                entry.sha256, progress, quant)
    repo_id = registry.HF_ALIASES.get(name, name)
    if "/" in repo_id:
        snap = registry.find_in_hf_cache(repo_id)
        if snap is not None:
            return repo_id, snap
    raise registry.not_found(name)


def _float_dirs(dir_name: str, quant: str, dtype: torch.dtype) -> list[str]:
    """The converted folders that serve a load, the one to convert into first: a quantized
    folder; for bf16 its own bf16 folder (half the disk; cast at load, a float32 folder gives the
    same values), or a float32 one already there; float32 for every other dtype."""
    if quant != "none":
        return [_quant_dir(dir_name, quant)]
    return [f"{dir_name}-bf16", dir_name] if dtype == torch.bfloat16 else [dir_name]


def _quant_dir(dir_name: str, quant: str) -> str:
    return dir_name if quant == "none" else f"{dir_name}-{quant}"


def _converted(source: Callable[[], Path], dir_names: list[str], source_key: str, progress: bool,
               quant: str = "none") -> Path:
    """The first of ``dir_names`` already converted from ``source_key``, else the first converted
    now from the GGUF file ``source()`` (fetched only then)."""
    for dir_name in dir_names:
        out = registry.converted_dir(dir_name)
        if registry.stamp_ok(out, source_key) and quant_of(out) == quant:
            return out
    dir_name = dir_names[0]
    out = registry.converted_dir(dir_name)
    with exclusive(graft_home() / "locks" / f"{dir_name}.lock"):   # two processes loading it first: one converts
        if registry.stamp_ok(out, source_key) and quant_of(out) == quant:
            return out
        from .gguf import convert_gguf  # imports the gguf package only when a conversion is needed

        gguf_path = source()
        if out.exists():
            log.warning("%s is incomplete or stale; converting %s again", out, gguf_path)
        convert_gguf(gguf_path, out, progress=progress, quant=quant,
                     dtype=torch.bfloat16 if dir_name.endswith("-bf16") else torch.float32)
        registry.write_stamp(out, source_key, progress)
    return out
