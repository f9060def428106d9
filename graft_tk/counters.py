"""What a decode step did, counted by the step that did it: kernel launches, host reads, torch ops.

``StepCounters`` is owned by one step of one batch. While the step runs it is the *active*
counter of its thread (a context variable, not a module global: two engines in two threads, such
as a server's decode thread and a benchmark's, never mix their figures); the kernels' ``launch``
and every device -> host read (``host_read``) add to it. ``count_torch_ops`` also counts every
torch op dispatched while it is active (a ``TorchDispatchMode``: slow, for tests and benchmarks).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class StepCounters:
    launches: Counter = field(default_factory=Counter)   # Triton launches by kernel name
    host_reads: int = 0                                  # device -> host reads (each waits for the device)
    torch_ops: int = 0                                   # torch ops dispatched (with count_torch_ops)
    count_torch_ops: bool = False

    def __iadd__(self, other: "StepCounters") -> "StepCounters":
        self.launches += other.launches
        self.host_reads += other.host_reads
        self.torch_ops += other.torch_ops
        return self


_ACTIVE: ContextVar[StepCounters | None] = ContextVar("graft_tk_step_counters", default=None)


class _OpCounter(TorchDispatchMode):
    def __init__(self, counters: StepCounters):
        super().__init__()
        self.counters = counters

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counters.torch_ops += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(counters: StepCounters):
    """Make ``counters`` the active counter of this thread while the block runs."""
    token = _ACTIVE.set(counters)
    try:
        if counters.count_torch_ops:
            with _OpCounter(counters):
                yield counters
        else:
            yield counters
    finally:
        _ACTIVE.reset(token)


def count_launch(kernel_name: str) -> None:
    """A Triton launch (``graft_tk.kernels._common.launch`` calls this)."""
    counters = _ACTIVE.get()
    if counters is not None:
        counters.launches[kernel_name] += 1


def host_read(*tensors: torch.Tensor) -> list:
    """Several tensors in ONE device -> host read (one wait for the device), counted: each flattened
    to a list, ints for integer and bool dtypes (exact below 2**53: token ids, slots, counts),
    floats otherwise. One tensor gives its list."""
    counters = _ACTIVE.get()
    if counters is not None:
        counters.host_reads += 1
    if len(tensors) == 1:
        t = tensors[0]
        return t.reshape(-1).tolist()
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        part = flat[at:at + t.numel()]
        out.append([int(x) for x in part] if not t.is_floating_point() else part)
        at += t.numel()
    return out
