"""Backends: which implementation runs the ops of a decode step.

Every op exists twice with the same signature: a Triton kernel in ``graft_tk.kernels`` and a
pure-torch reference in ``graft_tk.reference``. ``backend="auto"`` picks Triton on CUDA and torch
elsewhere; ``"triton"`` and ``"torch"`` force one. Without CUDA, Triton kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, set by ``graft_tk.kernels`` on import): exact but slow, for
tests, never for speed.
"""
from __future__ import annotations

from collections import Counter

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


class LaunchCounter:
    """Counts Triton kernel launches by kernel name (every launch goes through
    ``graft_tk.kernels._common.launch``)."""

    def __init__(self) -> None:
        self.by_kernel: Counter[str] = Counter()

    def add(self, kernel_name: str) -> None:
        self.by_kernel[kernel_name] += 1

    @property
    def count(self) -> int:
        return sum(self.by_kernel.values())

    def snapshot(self) -> Counter:
        return Counter(self.by_kernel)


LAUNCHES = LaunchCounter()


class HostReads:
    """The decode loop's device -> host reads: each one waits for the device to finish its queue,
    so a GPU step should make as few as it can. Every read of the engine, the drafters and the
    tree's size goes through ``read`` and is counted (the torch reference ops also read values on
    the host internally, free on a CPU; the Triton kernels read nothing back)."""

    def __init__(self) -> None:
        self.count = 0

    def read(self, t: torch.Tensor):
        """``t.tolist()``: a Python scalar for a 0-d tensor, else a (nested) list; counted."""
        self.count += 1
        return t.tolist()

    def read_many(self, *tensors: torch.Tensor) -> list[list]:
        """Several tensors in ONE read (one wait for the device): each one flattened to a list,
        ints for integer dtypes (exact below 2**53: token ids, slots, counts), floats otherwise."""
        flat = self.read(torch.cat([t.reshape(-1).double() for t in tensors]))
        out, at = [], 0
        for t in tensors:
            part = flat[at:at + t.numel()]
            out.append([int(x) for x in part] if not (t.is_floating_point() or t.is_complex()) else part)
            at += t.numel()
        return out


HOST_READS = HostReads()
