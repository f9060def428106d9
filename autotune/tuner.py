"""Tunable kernels, the search over their configs, and ``select``: the lookup a launcher makes.

    select("tree_attention", bucket, heuristic, device)
      CPU / interpreter        -> heuristic (no cache read, no search)
      cache hit (exact key)    -> the tuned config
      miss, GRAFT_TK_AUTOTUNE=1 on a GPU (not while a CUDA graph is captured)
                               -> benchmark every candidate, persist the fastest, use it
      miss otherwise           -> heuristic
    and on a GPU the answer is kept per (kernel, bucket, device) for the rest of the process.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import math
import os
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from graft_tk.errors import GraftError, InputError
from graft_tk.backend import interpreted

from . import cache
from .cache import Entry, Environment, Key

log = logging.getLogger(__name__)

# Registry of tunable kernels: name -> "module:attribute" of its Tunable, imported on first use
# (the kernel modules import this package, so it cannot import them at the top).
KERNELS = {"tree_attention": "graft_tk.autotune.tree_attention:TUNABLE",
           "cpu_linear": "graft_tk.autotune.cpu_linear:TUNABLE"}

Benchmark = Callable[[str, dict], float]   # (bucket, config) -> milliseconds


class AutotuneError(GraftError):
    """Tuning cannot run here (no GPU) or found no config that runs."""


@dataclass(frozen=True)
class Tunable:
    """A kernel whose meta-parameters are chosen per shape bucket."""
    name: str
    kernel: object                         # the @triton.jit function; its source is hashed into the key
    bucket: Callable[..., str]             # shape keywords -> canonical bucket string ("rows=64,head_dim=128,...")
    configs: Callable[[str], Sequence[dict]]  # bucket -> candidate configs
    heuristic: Callable[[str], dict]       # bucket -> the untuned default
    benchmark: Benchmark                   # times one config on a representative input of the bucket
    shapes: Sequence[dict] = field(default=())  # shape keywords that `graft-autotune tune` covers by default
    device: str = "cuda"                   # where it runs and is timed: "cuda" (Triton) or "cpu"


@functools.lru_cache(maxsize=None)
def get_tunable(name: str) -> Tunable:
    if name not in KERNELS:
        raise InputError(f"no tunable kernel named {name!r}; known: {', '.join(KERNELS)}")
    module, attr = KERNELS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def parse_bucket(bucket: str) -> dict:
    """"rows=64,dtype=bfloat16" -> {"rows": 64, "dtype": "bfloat16"} (digits become ints)."""
    out = {}
    for item in bucket.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or not name:
            raise InputError(f"bad shape {bucket!r}: expected name=value pairs separated by commas")
        out[name] = int(value) if re.fullmatch(r"-?\d+", value) else value
    return out


@functools.lru_cache(maxsize=None)
def source_hash(kernel) -> str:
    """sha256 of a Triton kernel's source from its ``def`` on (the same compiled or interpreted), or
    of a module's from its first ``def`` (``cpu_linear``: its paths live in one module)."""
    src = textwrap.dedent(inspect.getsource(getattr(kernel, "fn", kernel)))
    src = src[re.search(r"^def\s", src, re.MULTILINE).start():]
    return hashlib.sha256(src.encode()).hexdigest()


def key_for(tunable: Tunable, bucket: str, env: Environment | None = None) -> Key:
    return Key.make(tunable.name, bucket, source_hash(tunable.kernel), env or cache.environment())


def tuning_enabled() -> bool:
    return os.environ.get("GRAFT_TK_AUTOTUNE") == "1"


# --------------------------------------------------------------------------- search
def tune(tunable: Tunable, bucket: str, *, benchmark: Benchmark | None = None, path: Path | None = None,
         env: Environment | None = None, on_result: Callable[[dict, float], None] | None = None) -> Entry:
    """Time every candidate config of ``bucket`` (and the heuristic), persist the fastest, return its entry.

    ``benchmark`` defaults to the tunable's own (GPU timing); tests inject a fake timer. A config that
    fails to run (e.g. out of shared memory) is skipped with a warning in the log.
    """
    benchmark = benchmark or tunable.benchmark
    heuristic = tunable.heuristic(bucket)
    candidates = list(tunable.configs(bucket))
    if heuristic not in candidates:
        candidates.append(heuristic)
    times = []
    for config in candidates:
        try:
            ms = float(benchmark(bucket, config))
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot run is just not a candidate
            log.warning("%s %s: config %s failed (%s: %s); skipped", tunable.name, bucket, config,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            ms = math.inf
        times.append(ms)
        if on_result is not None:
            on_result(config, ms)
    best = min(range(len(candidates)), key=times.__getitem__)
    if math.isinf(times[best]):
        raise AutotuneError(f"no config of {tunable.name} ran for {bucket}; see the log (-v) for each failure")
    heuristic_ms = times[candidates.index(heuristic)]
    entry = Entry(key=key_for(tunable, bucket, env), config=candidates[best], time_ms=times[best],
                  heuristic_ms=None if math.isinf(heuristic_ms) else heuristic_ms, tuned_at=cache.now())
    cache.update([entry], path)
    return entry


def resolve(tunable: Tunable, bucket: str, heuristic: dict, *, tune_on_miss: bool,
            benchmark: Benchmark | None = None, path: Path | None = None, env: Environment | None = None) -> dict:
    """The cached config for ``bucket``; on a miss, tune it (``tune_on_miss``) or return ``heuristic``."""
    entry = cache.lookup(key_for(tunable, bucket, env), path)
    if entry is None and tune_on_miss:
        log.info("autotuning %s for %s", tunable.name, bucket)
        entry = tune(tunable, bucket, benchmark=benchmark, path=path, env=env)
    return dict(entry.config) if entry is not None else heuristic


# (kernel, bucket, device index) -> the config select resolved: every layer of every forward
# launches the attention kernel, so a lookup happens once per shape bucket per process, not once
# per launch (an entry graft-autotune writes later from another process applies on restart).
_SELECTED: dict[tuple[str, str, int], dict] = {}


def select(kernel: str, bucket: str, heuristic: dict, device) -> dict:
    """The tile sizes a launcher uses for ``bucket`` on ``device`` (see the module docstring)."""
    if interpreted() or device.type != "cuda":
        return heuristic
    import torch
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (kernel, bucket, index)
    if key not in _SELECTED:
        capturing = torch.cuda.is_current_stream_capturing()
        config = resolve(get_tunable(kernel), bucket, heuristic, tune_on_miss=tuning_enabled() and not capturing,
                         env=cache.environment(index))
        if capturing:          # a miss while capturing gets the heuristic now and a tuning later
            return config
        _SELECTED[key] = config
    return dict(_SELECTED[key])
