"""What a decode step costs on this device: the cost model the adaptive step policy decides by.

``StepCost`` holds measured curves, in milliseconds:

    verify_ms[n - 1]   a target forward of n tokens (a tree of n nodes), n = 1 .. N, after
                       ``context`` cached tokens
    verify_ms_per_1k   how much more each costs per 1,000 more cached tokens (the verify's
                       attention reads the whole context; ``at(context)`` applies it)
    draft_ms[w - 1]    a drafter forward of w tokens (a frontier of w nodes), w = 1 .. N (a
                       drafter reads a window of the prompt: its context stays short)
    step_ms            the rest of a step: build the tree, accept, commit, the host read

``graft_tk.calibration.cost.measure_step_cost`` measures them once per (target, drafter, device,
dtype) — ``graft-calibrate --cost-only``, a minute or two — and the profile keeps them in its
config (``GraftConfig.cost``).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import InputError


KNEE_RATIO = 1.5   # the verify's knee: the widest verify costing at most this many one-token forwards
MIN_MS = 1e-3      # a cost is positive: what a few tokens add to a wide forward is at least this


@dataclass(frozen=True)
class StepCost:
    verify_ms: tuple[float, ...]   # [n - 1]: target forward of n tokens
    draft_ms: tuple[float, ...]    # [w - 1]: drafter forward of w tokens; () without a drafter
    step_ms: float                 # a step's work outside the model forwards
    context: int = 0               # cached tokens when measured
    verify_ms_per_1k: tuple[float, ...] = ()   # [n - 1]: verify_ms's growth per 1,000 more cached tokens

    def __post_init__(self):
        for name in ("verify_ms", "draft_ms"):
            curve = tuple(float(x) for x in getattr(self, name))
            if not all(x > 0 and x == x for x in curve):
                raise InputError(f"StepCost.{name} must be positive milliseconds, got {curve[:4]}...")
            object.__setattr__(self, name, curve)
        if not self.verify_ms:
            raise InputError("StepCost.verify_ms is empty; measure it with graft-calibrate --cost-only")
        if not self.step_ms >= 0:
            raise InputError(f"StepCost.step_ms must be >= 0, got {self.step_ms!r}")
        growth = tuple(float(x) for x in self.verify_ms_per_1k)
        if growth and (len(growth) != len(self.verify_ms) or not all(x >= 0 for x in growth)):
            raise InputError(f"StepCost.verify_ms_per_1k must be {len(self.verify_ms)} non-negative milliseconds "
                             f"(one per verify width), got {growth[:4]}...")
        object.__setattr__(self, "verify_ms_per_1k", growth)

    def at(self, context: int) -> "StepCost":
        """This cost model after ``context`` cached tokens: each verify grows by its measured slope
        (never below what was measured: a shorter context is not assumed cheaper)."""
        if not self.verify_ms_per_1k or context <= self.context:
            return self
        k = (context - self.context) / 1000
        return dataclasses.replace(self, verify_ms=tuple(ms + k * g for ms, g in zip(self.verify_ms,
                                                                                     self.verify_ms_per_1k)),
                                   context=context)

    def batch(self, rows: int, riding: int = 0) -> "StepCost":
        """This cost model for a step of ``rows`` requests: a verify of n tokens per row costs a
        forward of rows x n tokens, a drafter forward of w tokens per row one of rows x w (their
        attention reads each row's own context: as many queries as the one wide forward). Past
        the measured curve a forward grows by the curve's mean slope over its upper half.
        ``riding``: the verify's forward carries that many prompt tokens besides (a chunk of a
        prompt being read), so a verify costs what its tokens add to theirs: the weight read is
        the chunk's, and each node costs about the curve's slope."""
        if rows == 1 and not riding:
            return self

        def added(curve: tuple[float, ...], n: int) -> float:
            return _extended(curve, riding + n) - (_extended(curve, riding) if riding else 0.0)
        n_verify = range(1, len(self.verify_ms) + 1)
        return dataclasses.replace(
            self, verify_ms=tuple(max(added(self.verify_ms, rows * n), MIN_MS) for n in n_verify),
            draft_ms=tuple(self.draft(rows * w) for w in range(1, len(self.draft_ms) + 1)),
            verify_ms_per_1k=tuple(max(added(self.verify_ms_per_1k, rows * n), 0.0)
                                   for n in range(1, len(self.verify_ms_per_1k) + 1)))

    def knee(self, ratio: float = KNEE_RATIO) -> int:
        """The widest verify costing at most ``ratio`` times a one-token forward: where a tree's
        nodes stop being nearly free (the budget N ``graft-calibrate --cost-only`` starts from)."""
        return max(n for n, ms in enumerate(self.verify_ms, 1) if ms <= ratio * self.verify_ms[0])

    def draft(self, width: int) -> float:
        """A drafter forward of ``width`` tokens (beyond the curve: its last point, scaled by width)."""
        if width <= len(self.draft_ms):
            return self.draft_ms[width - 1]
        return self.draft_ms[-1] * width / len(self.draft_ms)


def _extended(curve: tuple[float, ...], n: int) -> float:
    """curve[n - 1], or past its end its last point plus the mean slope of its upper half per token."""
    if n <= len(curve):
        return curve[n - 1]
    half = len(curve) // 2
    slope = (curve[-1] - curve[half - 1]) / (len(curve) - half) if half else curve[-1]
    return curve[-1] + (n - len(curve)) * max(slope, 0.0)


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after one untimed call."""
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1000


def forward_ms(run: Callable[[torch.Tensor, torch.Tensor, int], object], device: torch.device, q: int,
               prefix: int, repeats: int) -> float:
    """Median milliseconds of ``run(tokens [1, q], positions [q], start=prefix)`` after one untimed call."""
    return median_ms(lambda: run(torch.randint(1000, (1, q), device=device),
                                 torch.arange(prefix, prefix + q, device=device), prefix), device, repeats)
