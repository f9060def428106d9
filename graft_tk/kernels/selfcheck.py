"""Each Triton kernel checked on the GPU it is about to run on, before a decode trusts it.

The kernels are tested against their torch references in Triton's interpreter and compiled to
PTX in CI, but a GPU, a driver or a Triton release the tests never saw is where a kernel first
really runs. So on the first ``ops_for`` of a CUDA device in a process (and on
``graft-autotune check``) every op's kernel runs once on small seeded inputs
(``graft_tk.kernels.probes``) beside its reference, outputs and in-place inputs compared (seconds
in all). The verdict is kept in the autotune cache (kernel ``selfcheck``, bucket = the op), keyed
by the GPU, the kernel's source and the Triton / torch / graft_tk versions, so later processes
read it instead. An op whose kernel raised or disagreed runs its torch reference from then on,
with one warning that names it and says how to report it.

``GRAFT_TK_SELFCHECK=0`` trusts every kernel without checking.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import time
import warnings

import torch

from ..autotune import cache
from ..autotune.tuner import source_hash
from . import implementation, probes

KERNEL = "selfcheck"
# op -> its arguments at a small shape (a few ms per kernel once compiled)
PROBES = {
    "draft_expand": probes.draft_expand(probes.K, 1000, rows=2),
    "retrieve": probes.retrieve(1000, rows=2),
    "build_tree": probes.build_tree(16, 1000, depth=3, rows=2),
    "accept": probes.accept(16, 1000, rows=2),
    "commit_kv": probes.commit_kv(2, 2, 256, 64, 6, torch.bfloat16, rows=2),
    "tree_attention": probes.tree_attention(16, 300, torch.bfloat16, hq=4, hkv=2, d=64, rows=2),
    "prompt_lookup": probes.prompt_lookup(200, rows=2),
}
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (3e-3, 3e-3)}
log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()      # (device, op) warned about in this process


class KernelCheckWarning(UserWarning):
    """A Triton kernel failed its check on this device; its torch reference runs instead."""


def _source(op: str) -> str:
    """The hash of the op's kernel module (its launcher and every jitted kernel in it)."""
    return source_hash(importlib.import_module(f"graft_tk.kernels.{op}"))


def _differs(a, b, where: str = "output") -> str | None:
    """Why two results differ (floats within TOLERANCE, everything else exactly), or None."""
    if dataclasses.is_dataclass(a):         # e.g. a RetrievalTemplate: field by field
        a, b = (tuple(getattr(x, f.name) for f in dataclasses.fields(x)) for x in (a, b))
    if isinstance(a, (tuple, list)):
        for i, (x, y) in enumerate(zip(a, b)):
            if (why := _differs(x, y, f"{where}[{i}]")) is not None:
                return why
        return None
    if not isinstance(a, torch.Tensor):
        return None if a == b else f"{where}: {a!r} vs {b!r}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{where}: {a.dtype} {list(a.shape)} vs the reference's {b.dtype} {list(b.shape)}"
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        atol, rtol = TOLERANCE.get(a.dtype, (1e-4, 1e-4))
        if torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol, equal_nan=True):
            return None
        return f"{where}: max |difference| {(a.float() - b.float()).abs().max().item():.3g}"
    return None if torch.equal(a, b) else f"{where}: {int((a != b).sum())} of {a.numel()} values differ"


def check(op: str, device: torch.device) -> str | None:
    """Run ``op``'s kernel and reference on the same fresh inputs on ``device``: None when they
    agree, else what went wrong (an exception from compiling or running the kernel included)."""
    kernel, reference = implementation(op, "triton"), implementation(op, "torch")
    build = PROBES[op]
    want_args, got_args = build(device), build(device)
    want = reference(*want_args)
    try:
        got = kernel(*got_args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - a compiler or launch error of any kind
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return _differs(got, want) or _differs(tuple(got_args), tuple(want_args), "in-place input")


def _environment(device: torch.device) -> cache.Environment:
    return cache.environment(device.index if device.type == "cuda" else None)


def device_name(device: torch.device) -> str:
    """The GPU's name (or the CPU's) as the autotune cache keys it."""
    return _environment(device).gpu


def _key(op: str, device: torch.device) -> cache.Key:
    return cache.Key.make(KERNEL, f"op={op}", _source(op), _environment(device))


def failed_ops(device: torch.device | str, ops: tuple[str, ...] = tuple(PROBES), force: bool = False,
               path=None) -> dict[str, str]:
    """The ops whose kernel failed its check on ``device`` -> why; checked once per device, kernel
    source and versions (the verdicts live in the autotune cache ``path``, default its usual
    place), again with ``force``."""
    device = torch.device(device)
    if os.environ.get("GRAFT_TK_SELFCHECK", "1") == "0":
        return {}
    failed, fresh = {}, []
    for op in ops:
        key = _key(op, device)
        entry = None if force else cache.lookup(key, path)
        if entry is None:
            t0 = time.perf_counter()
            why = check(op, device)
            entry = cache.Entry(key, {"verdict": "ok"} if why is None else {"verdict": "failed", "why": why[:300]},
                                (time.perf_counter() - t0) * 1000, None, cache.now())
            fresh.append(entry)
            log.info("kernel check %s on %s: %s", op, key.gpu, why or "ok")
        if entry.config.get("verdict") != "ok":
            failed[op] = str(entry.config.get("why", "failed"))
    if fresh:
        try:
            cache.update(fresh, path)
        except OSError as e:     # a read-only cache: the verdicts hold for this process
            log.warning("could not store the kernel checks in %s (%s)", path or cache.cache_path(), e)
    for op, why in failed.items():
        if (str(device), op) not in _warned:
            _warned.add((str(device), op))
            warnings.warn(f"the Triton kernel of {op} failed its check on {device_name(device)} ({why}); {op} "
                          "runs its torch reference instead (slower, exact). Please report it to graft_tk's issue "
                          "tracker with the output of `graft-autotune check`", KernelCheckWarning, stacklevel=3)
    return failed
