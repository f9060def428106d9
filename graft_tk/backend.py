"""Backends: which implementation runs the ops of a decode step.

Every op exists twice with the same signature: a Triton kernel in ``graft_tk.kernels`` and a
pure-torch reference in ``graft_tk.reference``. ``backend="auto"`` picks Triton on CUDA and torch
elsewhere; ``"triton"`` and ``"torch"`` force one. Without CUDA, Triton kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, set by ``graft_tk.kernels`` on import): exact but slow, for
tests, never for speed.
"""
from __future__ import annotations

import os

import torch

from .errors import InputError

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """``"auto"`` -> ``"triton"`` on a CUDA device, else ``"torch"``; other values are checked and kept."""
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return backend


def interpreted() -> bool:
    """True when Triton kernels run in its CPU interpreter (no compilation, no autotuning)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
