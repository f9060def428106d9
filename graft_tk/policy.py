"""Drafting depth and verify width chosen per step by expected gain (a request alone, with a cost model).

A decode wants the most tokens per millisecond, R = E[tokens per step] / E[ms per step].
Dinkelbach's rule turns that ratio into per-step decisions: with R the rate reached so far,
something is worth doing when the tokens it is expected to add exceed R times the milliseconds
it costs; re-estimating R from the steps taken converges to the best ratio. With the device's
cost model (``graft_tk.cost.StepCost``) and the acceptance estimates (``graft_tk.acceptance``):

* depth: the next drafter forward (``draft_ms`` of its frontier) runs only if the likeliest node
  of the frontier could pay for it and its own verify row on its own: P(accepted | its score) >=
  R * (draft_ms + row_ms), row_ms the verify curve's mean slope up to N (~0 where flat). Through
  the estimates' score -> acceptance map this is a score threshold, the step's log tau (what
  ``draft_expand``'s stop flag compares with). The configured tau stays a lower bound on it and
  max_depth an upper bound on the depths.
* drafting at all: a step runs the drafter only while the drafted nodes accepted per drafting
  step pay for what a drafting step spends on them (its forwards and the drafted nodes' verify
  rows; decayed, with an optimistic prior of one node for one forward); otherwise the step verifies
  retrieval and prompt-lookup candidates alone, and every ``EXPLORE_EVERY``-th step drafts anyway
  to notice when the drafter becomes worth it again (a skipped drafter catches up on the tokens
  it missed in its next forward).
* width: of the tree built at the budget N, the verify takes the n likeliest nodes (root
  included) that maximise the tokens they are expected to add minus R times ``verify_ms[n - 1]``:
  where the verify is flat every node with any chance pays, where it is steep only the likely
  ones do. So a retrieved node competes with a drafted one for the same milliseconds, and N is
  an upper bound (``graft-calibrate --cost-only`` sets it at the measured verify's knee).

R is counted in the cost model's milliseconds of the steps taken, not the clock, so the choices
are reproducible. It starts at plain decoding's rate (one token per one-token verify plus a
step) and its counts decay by ``RATE_DECAY`` per step, so a change of workload is followed
within a few dozen steps. Candidate selection still happens before the target's forward, so the
output stays exactly that of plain decoding (and sampling stays exact).
"""
from __future__ import annotations

import math

from .config import verifiable
from .cost import StepCost

RATE_DECAY = 0.95
PRIOR_STEPS = 4.0   # plain decoding's rate, and one accepted drafted node per step, weigh this many steps at first
EXPLORE_EVERY = 8   # draft at least once in this many steps


class StepPolicy:
    """Drafting, its depth threshold and the verify's width per step (see the module docstring);
    lives as long as its engine."""

    def __init__(self, cost: StepCost, top_k: int, budget: int = 16):
        self.cost = cost
        self.top_k = max(verifiable(top_k, budget), 1)     # as wide as the step drafts
        n = min(budget, len(cost.verify_ms))
        # what one more verified node costs: the verify curve's mean slope up to N (~0 where flat)
        self.row_ms = (cost.verify_ms[n - 1] - cost.verify_ms[0]) / (n - 1) if n > 1 else 0.0
        self.tokens, self.ms = PRIOR_STEPS, PRIOR_STEPS * (cost.verify_ms[0] + cost.step_ms)
        # drafting steps: drafted nodes accepted, and ms spent (forwards + the drafted nodes' verify rows)
        self.drafted_accepted, self.drafting_steps = PRIOR_STEPS, PRIOR_STEPS
        self.drafting_ms = PRIOR_STEPS * (cost.draft(1) + self.row_ms) if cost.draft_ms else 0.0
        self.steps_without_drafting = 0

    @property
    def rate(self) -> float:
        """R: committed tokens per millisecond of the steps so far (decayed)."""
        return self.tokens / self.ms

    def should_draft(self) -> bool:
        """Run the drafter this step? (see the module docstring)"""
        if not self.cost.draft_ms:
            return True
        gain, spent = self.drafted_accepted / self.drafting_steps, self.drafting_ms / self.drafting_steps
        return gain >= self.rate * spent or self.steps_without_drafting + 1 >= EXPLORE_EVERY

    def depth_log_tau(self, draft_rates: list[float], edges: tuple[float, ...], log_tau_bound: float) -> float:
        """The step's drafting threshold: the lowest score whose estimated acceptance pays for a
        drafter forward of K nodes and its own verify row (``draft_rates`` [B], non-decreasing, per
        bucket of ``edges``; bucket b holds scores in (edges[b - 1], edges[b]]); +inf when no score does."""
        if not self.cost.draft_ms:
            return log_tau_bound
        p_min = self.rate * (self.cost.draft(self.top_k) + self.row_ms)
        for b, r in enumerate(draft_rates):
            if r >= p_min:
                return max(log_tau_bound, edges[b - 1] if b else -math.inf)
        return math.inf

    def verify_width(self, values: list[float]) -> int:
        """How many nodes to verify, root included: ``values`` are the other nodes' estimated log
        P(on the accepted path), best first (-inf: padding); the n maximising
        sum(P of the best n - 1) - R * verify_ms[n - 1] (n at most the curve's length)."""
        verify, rate = self.cost.verify_ms, self.rate
        best_n, best, gain = 1, -rate * verify[0], 0.0
        for n, value in enumerate(values[:len(verify) - 1], start=2):
            gain += math.exp(value)
            if gain - rate * verify[n - 1] > best:
                best_n, best = n, gain - rate * verify[n - 1]
        return best_n

    def observe(self, committed: int, verified: int, draft_widths: tuple[int, ...], drafted: bool,
                drafted_accepted: int, drafted_verified: int = 0) -> None:
        """Count a step: tokens committed, nodes verified, the widths of the drafter forwards it
        is charged for, whether it drafted, how many drafted nodes were accepted and verified."""
        c = self.cost
        drafting_ms = sum(c.draft(w) for w in draft_widths)
        ms = c.step_ms + c.verify_ms[min(verified, len(c.verify_ms)) - 1] + drafting_ms
        self.tokens = RATE_DECAY * self.tokens + committed
        self.ms = RATE_DECAY * self.ms + ms
        self.steps_without_drafting = 0 if drafted else self.steps_without_drafting + 1
        if drafted:
            self.drafted_accepted = RATE_DECAY * self.drafted_accepted + drafted_accepted
            self.drafting_steps = RATE_DECAY * self.drafting_steps + 1
            self.drafting_ms = RATE_DECAY * self.drafting_ms + drafting_ms + self.row_ms * drafted_verified


class DraftGate:
    """Draft less where the free sources already propose: whether a request decoding alone runs
    the drafter this step. Two situations are told apart by ``free``, the tokens prompt lookup's
    chain is expected to have accepted (from its acceptance estimates): a match (>= ``MATCH``) or
    none. In each, the gate keeps the committed tokens per second of the steps that drafted and of
    those that did not (decayed; times measured online: they change the speed, never the output)
    and takes the faster; the other is tried every ``EXPLORE_EVERY``-th step of that situation,
    and drafting is the default until both have been seen. A drafted node that prompt lookup
    proposed too counts as the drafter's, so the drafter's own acceptance overstates what it
    adds; the rates measure what a step gains from it."""

    MATCH = 1.0

    def __init__(self):
        # [situation][drafted]: decayed committed tokens and seconds
        self.tokens = [[0.0, 0.0], [0.0, 0.0]]
        self.seconds = [[0.0, 0.0], [0.0, 0.0]]
        self.since = [0, 0]          # steps of each situation since the arm not taken was tried
        self._last = 0

    def drafts(self, free: float) -> bool:
        k = self._last = int(free >= self.MATCH)
        if not self.seconds[k][1]:         # draft first, then try once without
            return True
        if not self.seconds[k][0]:
            return False
        rate = [self.tokens[k][d] / self.seconds[k][d] for d in (0, 1)]
        best = rate[1] >= rate[0]
        self.since[k] += 1
        if self.since[k] >= EXPLORE_EVERY:
            self.since[k] = 0
            return not best
        return best

    def observe(self, committed: int, seconds: float, drafted: bool) -> None:
        k, d = self._last, int(drafted)       # the situation of the last ``drafts`` call
        self.tokens[k][d] = RATE_DECAY * self.tokens[k][d] + committed
        self.seconds[k][d] = RATE_DECAY * self.seconds[k][d] + seconds
