"""Warm start for the search: a tau suggested by the drafter's own acceptance data.

During a few runs at the default config the engine logs, for every verified node, (source,
depth, drafter score, accepted?). A drafted node's score is its path log-probability under the
drafter; fitting a monotone (isotonic) map score -> P(accepted) turns scores into acceptance
odds. Pruning at tau trades drafted nodes scoring below log(tau) for retrieval nodes, so the
break-even tau is where a drafted node's expected acceptance falls to the acceptance rate of
the retrieval nodes that would take its place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graft_tk.tree import DRAFT, PROMPT_LOOKUP, RETRIEVAL, SUFFIX

TAU_RANGE = (1e-3, 0.9)   # the search space's tau bounds; the suggestion is clipped into them


def isotonic_increasing(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares non-decreasing fit of y on x (pool-adjacent-violators).

    Returns (x sorted, fitted y at each x). Equal x values are pooled first, so the fit is a
    function of x.
    """
    order = np.argsort(x, kind="stable")
    xs, ys = np.asarray(x, float)[order], np.asarray(y, float)[order]
    ux, start = np.unique(xs, return_index=True)
    sums, counts = np.add.reduceat(ys, start), np.diff(np.append(start, len(xs))).astype(float)
    # blocks of (sum, count) merged while a block's mean exceeds its right neighbour's
    block_sum, block_cnt, block_len = [], [], []
    for s, c in zip(sums, counts):
        block_sum.append(s), block_cnt.append(c), block_len.append(1)
        while len(block_sum) > 1 and block_sum[-2] / block_cnt[-2] > block_sum[-1] / block_cnt[-1]:
            s2, c2, n2 = block_sum.pop(), block_cnt.pop(), block_len.pop()
            block_sum[-1] += s2
            block_cnt[-1] += c2
            block_len[-1] += n2
    fitted_unique = np.repeat([s / c for s, c in zip(block_sum, block_cnt)], block_len)
    return xs, fitted_unique[np.searchsorted(ux, xs)]


@dataclass(frozen=True)
class WarmStart:
    tau: float                      # the suggested threshold, clipped into TAU_RANGE
    retrieval_acceptance: float     # P(accepted) of a retrieved node, the break-even bar
    drafted_nodes: int
    retrieved_nodes: int
    acceptance_by_depth: dict       # depth -> (drafted nodes, accepted fraction)
    curve: tuple                    # ((score, fitted P(accept)), ...) at the fit's breakpoints

    def describe(self) -> str:
        depths = ", ".join(f"d{d} {p:.2f} ({n})" for d, (n, p) in sorted(self.acceptance_by_depth.items()))
        return (f"warm start: {self.drafted_nodes} drafted / {self.retrieved_nodes} retrieved nodes logged; "
                f"retrieved nodes accepted {self.retrieval_acceptance:.3f}; drafted accepted by depth: "
                f"{depths or 'none'}; suggested tau = {self.tau:.4g}")


def suggest_tau(log: list[tuple[int, int, float, bool]], default_tau: float = 0.1) -> WarmStart:
    """Fit score -> P(accept) on drafted nodes and return the tau where it meets retrieval's rate.

    log: (source, depth, score, accepted) per verified node, from ``Engine.acceptance_log``,
    gathered with a drafter tree (drafted scores) and retrieval (retrieved nodes' rate). With
    too little data for either, ``default_tau`` is returned unchanged.
    """
    drafted = [(d, s, a) for src, d, s, a in log if src == DRAFT and math.isfinite(s)]
    retrieved = [a for src, _, _, a in log if src in (RETRIEVAL, PROMPT_LOOKUP, SUFFIX)]
    by_depth: dict[int, list[bool]] = {}
    for d, _, a in drafted:
        by_depth.setdefault(d, []).append(a)
    acceptance_by_depth = {d: (len(v), sum(v) / len(v)) for d, v in by_depth.items()}
    p_ret = sum(retrieved) / len(retrieved) if retrieved else float("nan")
    if len(drafted) < 10 or not retrieved:
        return WarmStart(default_tau, p_ret, len(drafted), len(retrieved), acceptance_by_depth, ())
    scores = np.array([s for _, s, _ in drafted])
    accepted = np.array([float(a) for _, _, a in drafted])
    xs, fitted = isotonic_increasing(scores, accepted)
    above = np.nonzero(fitted >= p_ret)[0]
    # the lowest score whose expected acceptance still beats a retrieved node; none -> keep only the best
    log_tau = xs[above[0]] if len(above) else xs[-1]
    tau = float(min(max(math.exp(log_tau), TAU_RANGE[0]), TAU_RANGE[1]))
    change = np.nonzero(np.diff(fitted, prepend=-1.0))[0]
    curve = tuple((float(xs[i]), float(fitted[i])) for i in change)
    return WarmStart(tau, p_ret, len(drafted), len(retrieved), acceptance_by_depth, curve)
