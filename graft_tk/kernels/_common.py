"""Shared kernel plumbing: every launch is counted (``DecodeResult.stats`` reports launches per step)."""
from __future__ import annotations

import os

from ..backend import LAUNCHES


def interpreted() -> bool:
    """True when kernels run in Triton's CPU interpreter (no compilation, no autotuning)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, counted in ``graft_tk.backend.LAUNCHES``."""
    LAUNCHES.add(getattr(kernel, "__name__", None) or kernel.fn.__name__)
    return kernel[grid](*args, **kwargs)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (Triton block sizes must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()
