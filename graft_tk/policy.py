"""What a step does, decided per step: the step controllers.

A ``StepController`` turns the batch's config into a ``StepPlan`` (the verify budget N, which rows
draft, each row's pruning threshold, the drafter's depth and width), may narrow the verify once
the tree is built (``width``), and learns from the step's ``Observation``. The base class is the
fixed plan (the config as it is: no host read, no learning); ``Controllers`` chains several.
``graft_tk.state.SpecState.controller`` chooses the controllers of a batch:

* ``StepPolicy`` (below): drafting, its depth and the verify's width by expected gain per
  millisecond, with the device's cost model;
* ``DraftGate`` (below): no drafting where the free sources already propose what the drafter would,
  and a copy verified as far as it is likely;
* ``PlainCheck`` (below): a batch speculates only while it measurably commits more tokens per
  second than plain decoding;
* the batch-size policy, N, tau and D by the number of requests in flight, is a choice of config
  (``graft_tk.batch.Batch.plan``), planned by these like any other.

The draft gate steers a request decoding alone (its situations are that request's). The cost
policy steers batches too, one ``StepPolicy`` per batch size: the same rule with the batch's
costs and rate, so at any size plain decoding is one of its choices; and since its estimates can
be wrong for a batch, a ``PlainCheck`` per batch size holds it to plain decoding's measured rate
(``SpecState.controller``).

``StepPolicy``: drafting depth and verify width chosen per step by expected gain (with a cost model).

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
  it missed in its next forward); each such try that does not pay doubles the wait, up to
  ``EXPLORE_MAX`` steps. A batch of B rows waits B times as long (its drafting step runs the
  drafter over every row: at 4 rows on a 2-core Zen 4 a try costs ~1-1.5 s against ~0.25 s for
  a plain step, and in a graft-serve run the tries of sizes 2-4 ran at a third of plain's rate).
* width: of the tree built at the budget N, the verify takes the n likeliest nodes (root
  included) that maximise the tokens they are expected to add minus R times ``verify_ms[n - 1]``:
  where the verify is flat every node with any chance pays, where it is steep only the likely
  ones do. So a retrieved node competes with a drafted one for the same milliseconds, and N is
  an upper bound (``graft-calibrate --cost-only`` sets it at the measured verify's knee).

Every cost is the cost model's at the step's context (``StepCost.at``: the longest row's committed
tokens): a long prompt makes each verify dearer, while a drafter, reading a window, costs the same.

R is counted in the cost model's milliseconds of the steps taken, not the clock, so the choices
are reproducible. It starts at plain decoding's rate (one token per one-token verify plus a
step), never falls below it (plain decoding can always reach it), and its counts decay by
``RATE_DECAY`` per step, so a change of workload is followed within a few dozen steps. Candidate
selection still happens before the target's forward, so the output stays exactly that of plain
decoding (and sampling stays exact).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from torch import Tensor

from .acceptance import SCORE_EDGES
from .config import GraftConfig, verifiable
from .cost import StepCost
from .counters import host_read
from .methods import Method

RATE_DECAY = 0.95
PRIOR_STEPS = 4.0   # plain decoding's rate, and one accepted drafted node per step, weigh this many steps at first
EXPLORE_EVERY = 8   # draft at least once in this many steps
EXPLORE_MAX = 64    # the longest wait between tries of the arm not taken (draft gate, cost policy)
BELIEF_MIN = 0.1    # a batch's estimates are believed at least this much (``StepPolicy.belief``)
BELIEF_PRIOR = 0.05  # added to both counts per step: with nothing observed they settle at one node each


@dataclass(frozen=True)
class StepPlan:
    """What one step does, per row of the batch (host values, decided before the target's forward)."""
    budget: int                   # N: nodes verified per row, root included (1: plain decoding)
    drafts: tuple[bool, ...]      # each row runs the drafter this step
    log_tau: tuple[float, ...]    # each row's pruning threshold on drafter scores (-inf: never prunes)
    depth: int                    # drafter forwards after the first, at most (its depths)
    top_k: int                    # K: children per expanded node, the frontier's width
    context: int = 0              # the longest row's committed tokens (what the verify attends over)
    unread: tuple[bool, ...] = ()   # each row's drafter would first read a long prompt's window (``Drafter.unread``)
    riding: int = 0               # prompt tokens read in the verify's forward (a chunk of a prompt arriving)

    @classmethod
    def fixed(cls, methods: Sequence[Method], config: GraftConfig, context: int = 0,
              unread: tuple[bool, ...] = (), riding: int = 0) -> "StepPlan":
        """The config as it is, for rows of these methods: N = budget when any row speculates;
        drafts no deeper or wider than N nodes can verify."""
        N = config.budget if any(m.speculates for m in methods) else 1
        return cls(N, tuple(m.drafts and N > 1 for m in methods),
                   tuple(math.log(config.tau) if m.prune else -math.inf for m in methods),
                   verifiable(config.max_depth, N), verifiable(config.top_k, N), context, unread, riding)

    @property
    def drafting(self) -> bool:
        return any(self.drafts) and self.depth > 0


@dataclass(frozen=True)
class Observation:
    """What a step did, summed over its rows, for the controllers to learn from."""
    committed: int                # tokens committed
    seconds: float                # its wall time
    verified: int                 # nodes per row the verify held
    draft_widths: tuple[int, ...]  # tokens per row in each drafter forward
    drafted: bool                 # the drafter ran
    drafted_accepted: int         # drafted nodes accepted
    drafted_verified: int         # drafted nodes verified
    draft_rates: list[float] | None = None   # the drafter's rates by score bucket, when asked for
    expected: float = 0.0         # the verified nodes (root aside) the estimates expected accepted
    accepted: int = 0             # those accepted


class RankedValues:
    """A built tree's node values for the controllers' ``width``: per rank (best first, the root
    left out), the log of the rows' nodes of that rank summed, what verifying one more node per
    row adds. Read to the host once, when a controller first asks (``host``)."""

    def __init__(self, values: Tensor):
        self.values, self._host = values, None     # [B, N] each node's estimated log P(on the accepted path)

    def host(self) -> list[float]:
        if self._host is None:
            self._host = host_read(self.values[:, 1:].sort(1, descending=True).values.exp().sum(0).log())
        return self._host


class StepController:
    """The fixed plan; a controller overrides what it decides. ``free`` [B] (on the device, None
    when no source gives one): the tokens the candidates proposed before drafting are expected to
    get accepted; reading it is a host read, so only a controller that uses it reads it."""
    wants_draft_rates = False     # the step's host read brings it ``Observation.draft_rates``

    def plan(self, plan: StepPlan, free: Tensor | None) -> StepPlan:
        return plan

    def width(self, plan: StepPlan, values: RankedValues) -> int:
        """Nodes to verify of the tree built at N (``values``: its nodes' by rank): N keeps it."""
        return plan.budget

    def observe(self, plan: StepPlan, seen: Observation) -> None:
        pass

    def may_draft(self) -> bool:
        """Whether the coming steps may run the drafter (if not, a new row's drafter read waits)."""
        return True


class Controllers(StepController):
    """Several controllers in turn: each refines the plan the one before left; the narrowest width."""

    def __init__(self, *parts: StepController):
        self.parts = parts
        self.wants_draft_rates = any(p.wants_draft_rates for p in parts)

    def plan(self, plan: StepPlan, free: Tensor | None) -> StepPlan:
        for p in self.parts:
            plan = p.plan(plan, free)
        return plan

    def width(self, plan: StepPlan, values: RankedValues) -> int:
        return min(p.width(plan, values) for p in self.parts) if self.parts else plan.budget

    def observe(self, plan: StepPlan, seen: Observation) -> None:
        for p in self.parts:
            p.observe(plan, seen)

    def may_draft(self) -> bool:
        return all(p.may_draft() for p in self.parts)


class StepPolicy(StepController):
    """Drafting, its depth threshold and the verify's width per step (see the module docstring);
    lives as long as its state. ``draft_rates``: the drafter's rates by score bucket (host floats,
    read back by every step it steers; None before the first: the configured tau is the
    threshold); ``fixed_width``: the verify keeps N (a compiled target: every new width would
    compile a graph).

    ``rows``: the steps it steers hold this many requests. Their costs are the batch's
    (``StepCost.batch``: a verify of n nodes per row is one forward of rows x n tokens), R is
    the batch's tokens per ms, the verify takes the width whose nodes, summed over the rows, pay
    for it, and every row drafts or none does. Plain decoding (width 1, no drafting) is always
    one of the choices, so a batch speculates only as far as its measured costs say it pays."""
    wants_draft_rates = True

    def __init__(self, cost: StepCost, top_k: int, budget: int = 16, draft_rates: list[float] | None = None,
                 fixed_width: bool = False, rows: int = 1):
        self.budget, self.draft_rates, self.fixed_width, self.rows = budget, draft_rates, fixed_width, rows
        self.single = cost                  # one row's; a step carrying a prompt chunk costs what it adds to it
        self.measured = cost = cost.batch(rows)
        self.top_k = max(verifiable(top_k, budget), 1)     # as wide as the step drafts
        self.at_context(cost.context)
        # plain decoding's rate: a token per row for a one-token verify and a step
        self.plain_rate = rows / (cost.verify_ms[0] + cost.step_ms)
        self.tokens, self.ms = PRIOR_STEPS * rows, PRIOR_STEPS * rows / self.plain_rate
        # drafting steps: drafted nodes accepted, and ms spent (forwards + the drafted nodes' verify
        # rows). A request alone starts drafting (one node per forward); a batch waits for its first
        # try (4 rows on a 2-core Zen 4: a drafting step ~0.9-1.5 s against 0.25 s for a plain one)
        self.drafted_accepted = PRIOR_STEPS * rows if rows == 1 else 0.0
        self.drafting_ms = PRIOR_STEPS * (cost.draft(1) + self.row_ms) if cost.draft_ms else 0.0
        self.steps_without_drafting = 0
        self.explore_first, self.explore_max = EXPLORE_EVERY * rows, EXPLORE_MAX * rows   # a try's cost grows with rows
        self.explore_every, self.exploring = self.explore_first, False   # the wait between tries; this step is one
        # a batch's nodes accepted and expected (decayed; equal priors): ``belief`` scales the estimates
        self.accepted = self.expected = BELIEF_PRIOR / (1 - RATE_DECAY)

    def at_context(self, context: int, riding: int = 0) -> None:
        """Decide with the costs after ``context`` cached tokens (``StepCost.at``), of a step whose
        verify carries ``riding`` prompt tokens (``StepCost.batch``)."""
        cost = self.cost = (self.single.batch(self.rows, riding) if riding else self.measured).at(context)
        n = min(self.budget, len(cost.verify_ms))
        # what one more verified node costs: the verify curve's mean slope up to N (~0 where flat)
        self.row_ms = (cost.verify_ms[n - 1] - cost.verify_ms[0]) / (n - 1) if n > 1 else 0.0

    @property
    def rate(self) -> float:
        """R: committed tokens per millisecond of the steps so far (decayed), at least plain
        decoding's: a rate it can always reach. (The steps' own rate alone let drafting that
        lowered it confirm itself: 4 rows on a 2-core CPU drafted every step at 12 tokens/s, where
        plain decoding makes 20.)"""
        return max(self.tokens / self.ms, self.plain_rate)

    def should_draft(self) -> bool:
        """Run the drafter this step? (see the module docstring)"""
        if not self.cost.draft_ms:
            return True
        if self.pays():
            self.explore_every, self.exploring = self.explore_first, False
            return True
        self.exploring = self.try_due()
        return self.exploring

    def try_due(self) -> bool:
        """Whether the next step is a try of drafting (it has waited ``explore_every`` steps)."""
        return self.steps_without_drafting + 1 >= self.explore_every

    def may_draft(self) -> bool:
        """Whether drafting is due (it pays, or a try is): only then does a batch's row whose
        drafter has read nothing read its prompt, between steps (a row of a long prompt: ~1.3 s
        on a 2-core Zen 4, lost where the batch then does not draft)."""
        return not self.cost.draft_ms or self.pays() or self.try_due()

    def pays(self) -> bool:
        """Whether the drafted nodes accepted pay for what the drafting steps spent on them (both
        decayed sums over those steps)."""
        return self.drafted_accepted >= self.rate * self.drafting_ms

    def depth_log_tau(self, draft_rates: list[float] | None, edges: tuple[float, ...], log_tau_bound: float) -> float:
        """The step's drafting threshold: the lowest score whose estimated acceptance pays for a
        drafter forward of K nodes and its own verify row (``draft_rates`` [B], non-decreasing, per
        bucket of ``edges``; bucket b holds scores in (edges[b - 1], edges[b]]); +inf when no score does."""
        if not self.cost.draft_ms or draft_rates is None:
            return log_tau_bound
        p_min = self.rate * (self.cost.draft(self.top_k) + self.row_ms) / self.rows   # a row's share
        for b, r in enumerate(draft_rates):
            if r >= p_min:
                return max(log_tau_bound, edges[b - 1] if b else -math.inf)
        return math.inf

    @property
    def belief(self) -> float:
        """What a batch's estimates are worth: its verified nodes accepted per node expected
        (decayed), between BELIEF_MIN and 1; 1 for a request alone, whose estimates are the
        sources' own. The estimates are learnt per source and depth, not per batch size, and
        a batch's rows can get far less than they say: 4 rows on a 2-core Zen 4 expected
        >= 0.72 tokens from their second nodes and got ~0.2."""
        if self.rows == 1:
            return 1.0
        return min(max(self.accepted / self.expected, BELIEF_MIN), 1.0)

    def verify_width(self, values: list[float]) -> int:
        """How many nodes to verify per row, root included: ``values`` are the other nodes' estimated
        log P(on the accepted path), best first (-inf: padding; several rows: per rank, the log of
        the rows' nodes of that rank summed); the n maximising
        belief * sum(P of the best n - 1) - R * verify_ms[n - 1] (n at most the curve's length)."""
        verify, rate, belief = self.cost.verify_ms, self.rate, self.belief
        best_n, best, gain = 1, -rate * verify[0], 0.0
        for n, value in enumerate(values[:len(verify) - 1], start=2):
            gain += belief * math.exp(value)
            if gain - rate * verify[n - 1] > best:
                best_n, best = n, gain - rate * verify[n - 1]
        return best_n

    # ---------------------------------------------------------------- as a step controller
    def plan(self, plan: StepPlan, free: Tensor | None) -> StepPlan:
        """Each pruning row's threshold from the cost of a drafter forward; no drafting when it does
        not pay. A plain step (planned so before this controller) stays as it is."""
        if plan.budget == 1:
            return plan
        self.at_context(plan.context, plan.riding)
        log_tau = tuple(t if t == -math.inf else self.depth_log_tau(self.draft_rates, SCORE_EDGES, t)
                        for t in plan.log_tau)
        drafts = plan.drafts if self.should_draft() else (False,) * len(plan.drafts)
        return dataclasses.replace(plan, log_tau=log_tau, drafts=drafts)

    def width(self, plan: StepPlan, values: RankedValues) -> int:
        return plan.budget if self.fixed_width else self.verify_width(values.host())

    def observe(self, plan: StepPlan, seen: Observation) -> None:
        if seen.draft_rates is not None:
            self.draft_rates = seen.draft_rates
        if plan.riding:     # a step carrying a prompt's chunk: its forward is the chunk's, not the rate's
            self.at_context(plan.context)
        else:
            self.count(seen.committed, seen.verified, seen.draft_widths, seen.drafted, seen.drafted_accepted,
                       seen.drafted_verified)
        # decayed every step, with a step's worth of prior: a batch that stopped verifying wide
        # drifts back to believing its estimates, and tries wider trees again
        self.accepted = RATE_DECAY * self.accepted + seen.accepted + BELIEF_PRIOR
        self.expected = RATE_DECAY * self.expected + seen.expected + BELIEF_PRIOR

    def count(self, committed: int, verified: int, draft_widths: tuple[int, ...], drafted: bool,
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
            self.drafting_ms = RATE_DECAY * self.drafting_ms + drafting_ms + self.row_ms * drafted_verified / self.rows
            if self.exploring and not self.pays():      # a try that confirmed not drafting: wait longer
                self.explore_every = min(2 * self.explore_every, self.explore_max)
            self.exploring = False


class PlainCheck(StepController):
    """Speculation against plain decoding, by what each measurably commits per second, in each
    situation of the batch: a batch speculates (as the controllers after this one plan it) where
    that is faster than plain decoding, and otherwise decodes plainly, each step skipping the
    drafter, the pool's sources and the tree's build. Situations are the draft gate's, told apart
    by the expected free tokens of the batch's rows summed (``free``: prompt lookup's chains):
    none, a match and a copy. A plain step costs the same in every situation, so plain decoding's
    rate is one, measured over all of them; speculation's is measured per situation (4 rows on a
    2-core Zen 4: steps copying a prompt made 22-23 tokens/s, steps of short open answers less
    than plain decoding's 15). In each situation the arm not taken is tried every
    ``EXPLORE_EVERY``-th step of it at first, each try that confirms the choice doubling the wait,
    up to ``EXPLORE_MAX`` steps; a try that changes it resets it. Speculation goes first, until
    both are measured. A try of speculation does not draft (the rows' drafters, unread while the
    batch decodes plainly, would read their prompts inside that step: seconds for every row); once
    speculation is back the cost policy tries drafting as it does. Times are measured online, so
    they change the speed, never the output.
    Why measured and not estimated: the cost policy's choices rest on acceptance estimates that
    a batch can overstate (4 rows on a 2-core Zen 4: steps verifying 2-3 nodes a row expected
    >= 0.72 tokens from the rows' second nodes and got ~0.2, making 4.2-5.2 tokens per 264-300 ms
    where plain decoding makes 4 per 197 ms)."""

    SPECULATE, PLAIN = 0, 1

    def __init__(self):
        k = len(DraftGate.LEVELS) + 1
        self.plain = [0.0, 0.0]                        # plain steps' committed tokens, seconds (decayed)
        self.speculating = [[0.0, 0.0] for _ in range(k)]   # the same per situation
        self.since, self.every = [0] * k, [EXPLORE_EVERY] * k
        self.situation = 0                             # the last planned step's
        self._tried: int | None = None                 # this step tries the other arm than this best one
        self._asked = False                            # this step's plan asked the check

    def best(self, k: int | None = None) -> int:
        """Situation ``k``'s arm of the higher measured rate (the last step's situation by default);
        speculation until both are measured."""
        spec = self.speculating[self.situation if k is None else k]
        if not (spec[1] and self.plain[1]):
            return self.SPECULATE
        return self.SPECULATE if spec[0] / spec[1] >= self.plain[0] / self.plain[1] else self.PLAIN

    def plan(self, plan: StepPlan, free: Tensor | None) -> StepPlan:
        """A step carrying a prompt's chunk takes the situation's best arm, neither a try nor counted:
        its time is mostly the chunk's."""
        self._asked, self._tried = plan.budget > 1 and not plan.riding, None
        if plan.budget == 1:
            return plan
        k = DraftGate.situation(0.0 if free is None else sum(host_read(free)))
        arm = self.best(k)
        if self._asked:
            self.situation = k
            self.since[k] += 1
            if self.since[k] >= self.every[k]:
                self.since[k], self._tried, arm = 0, arm, 1 - arm
        undrafted = (False,) * len(plan.drafts)
        if arm == self.PLAIN:
            return dataclasses.replace(plan, budget=1, drafts=undrafted)
        return plan if self._tried is None else dataclasses.replace(plan, drafts=undrafted)

    def observe(self, plan: StepPlan, seen: Observation) -> None:
        if not self._asked:
            return
        for counts in (self.plain, *self.speculating):
            counts[0] *= RATE_DECAY
            counts[1] *= RATE_DECAY
        counts = self.plain if plan.budget == 1 else self.speculating[self.situation]
        counts[0] += seen.committed
        counts[1] += seen.seconds
        if self._tried is not None:
            k = self.situation
            self.every[k] = min(2 * self.every[k], EXPLORE_MAX) if self.best(k) == self._tried else EXPLORE_EVERY

    def may_draft(self) -> bool:
        return self.best() == self.SPECULATE


class DraftGate(StepController):
    """Draft less where the free sources already propose, and verify a copy as far as it goes:
    what a request decoding alone does this step. Situations are told apart by ``free``, the
    tokens prompt lookup's chain is expected to have accepted (from its acceptance estimates):
    none, a match (>= 1) and a copy (>= 4: the answer is copying a span of the context; there a
    drafted node mostly displaces a copied one). Each situation has its arms: not drafting and
    drafting, and in a copy a third, ``WIDE``: not drafting, the verify as wide as the chain is
    likely (its nodes with P(on the accepted path) >= ``WIDE_P``, between the plan's N and
    ``GraftConfig.copy_budget``; on 2k-token code edits a 16-node verify accepted 15 nodes a step:
    the budget, not the chain, stopped the copy). In each situation the gate keeps the committed
    tokens per second of every arm's steps (decayed; times measured online: they change the
    speed, never the output) and takes the fastest measured, the situation's first arm until
    then (drafting; in a copy the wide verify, else not drafting); another arm is tried every
    ``EXPLORE_EVERY``-th step of that situation at first (in turn; a copy of a few steps never
    runs the drafter), and each try that confirms the choice doubles that wait, up to
    ``EXPLORE_MAX`` steps (a skipped drafter's try also reads every token it missed: on a
    2k-token code edit a try every 8 copied steps cost a fifth of the decode); a try that changes
    the choice resets it.
    A request with a long prompt whose drafter has read nothing yet (a drafter model reads the
    window in its first drafting step, 1.3 s for 260 tokens through the int4 kernel on a 2-core
    Zen 4) starts it only where the free sources find no match: on a long copy the first steps
    match by a token or two, and drafting them paid that read for fewer tokens than the free
    chain alone gets.
    A drafted node that prompt lookup proposed too counts as the drafter's, so the drafter's own
    acceptance overstates what it adds; the rates measure what a step gains from it.
    ``wide``: the widest verify of a copy (``GraftConfig.copy_budget``; 0: no wide arm); the
    narrowest is the plan's N."""

    LEVELS = (1.0, 4.0)      # the expected free tokens from which a situation starts (after "none")
    NARROW, DRAFTING, WIDE = 0, 1, 2     # the arms: not drafting, drafting, not drafting verifying wide
    WIDE_P = 0.5             # a wide verify holds the nodes at least this likely to be accepted

    def __init__(self, wide: int = 0):
        self.wide = wide
        self._budget = 0             # this step's N before the gate widened it
        copy = (self.WIDE, self.NARROW, self.DRAFTING) if self.wide else (self.NARROW, self.DRAFTING)
        self.arms = ((self.DRAFTING, self.NARROW), (self.DRAFTING, self.NARROW), copy)   # per situation, first first
        # [situation][arm]: decayed committed tokens and seconds
        k = len(self.arms)
        self.tokens = [[0.0] * 3 for _ in range(k)]
        self.seconds = [[0.0] * 3 for _ in range(k)]
        self.since = [0] * k         # steps of each situation since another arm was tried
        self.every = [EXPLORE_EVERY] * k     # each situation's wait between such tries
        self.turn = [0] * k          # which of the other arms the next try takes
        self._last = 0
        self._tried: int | None = None       # the last step tried another arm than this best one
        self._asked = False          # this step's plan asked the gate

    # ---------------------------------------------------------------- as a step controller
    def plan(self, plan: StepPlan, free: Tensor | None) -> StepPlan:
        """Row 0 (the request decoding alone) drafts or not, and how wide its copy's verify may
        be, by the free sources' signal (one host read)."""
        self._asked = free is not None and plan.budget > 1 and plan.drafts[0]
        if not self._asked:
            return plan
        arm = self.arm(host_read(free)[0], bool(plan.unread and plan.unread[0]))
        self._budget = plan.budget
        return dataclasses.replace(plan, drafts=(arm == self.DRAFTING,) + plan.drafts[1:],
                                   budget=max(self.wide, plan.budget) if arm == self.WIDE else plan.budget)

    def width(self, plan: StepPlan, values: RankedValues) -> int:
        """A wide verify: its nodes with P >= WIDE_P, at least N."""
        if not self._asked or plan.budget <= self._budget:
            return plan.budget
        likely = sum(v >= math.log(self.WIDE_P) for v in values.host())
        return min(max(1 + likely, self._budget), plan.budget)

    def observe(self, plan: StepPlan, seen: Observation) -> None:
        if self._asked:
            arm = self.DRAFTING if seen.drafted else self.WIDE if plan.budget > self._budget else self.NARROW
            self.count(seen.committed, seen.seconds, arm)

    def arm(self, free: float, unread: bool = False) -> int:
        """This step's arm. ``unread``: the drafter would first read this request's long prompt."""
        k = self._last = self.situation(free)
        self._tried = None
        arms = self.arms[k]
        best = self.best(k)
        if unread and k > 0:     # the free sources match: they go first, the drafter's read waits
            return best if best != self.DRAFTING else next(a for a in arms if a != self.DRAFTING)
        self.since[k] += 1
        if self.since[k] >= self.every[k]:
            others = [a for a in arms if a != best]
            self.since[k], self._tried = 0, best
            self.turn[k] += 1
            return others[(self.turn[k] - 1) % len(others)]
        return best

    @classmethod
    def situation(cls, free: float) -> int:
        """The situation of ``free`` expected free tokens: 0 none, 1 a match, 2 a copy."""
        return sum(free >= level for level in cls.LEVELS)

    def drafts(self, free: float, unread: bool = False) -> bool:
        """Draft this step? (``arm`` is DRAFTING)"""
        return self.arm(free, unread) == self.DRAFTING

    def best(self, k: int) -> int:
        """Situation ``k``'s fastest measured arm; its first arm until that is measured."""
        arms = self.arms[k]
        if not self.seconds[k][arms[0]]:
            return arms[0]
        measured = [a for a in arms if self.seconds[k][a]]
        return max(measured, key=lambda a: (self.tokens[k][a] / self.seconds[k][a], -arms.index(a)))

    def count(self, committed: int, seconds: float, arm: int) -> None:
        """Count a step of the last ``arm`` call's situation that ran ``arm``."""
        k = self._last
        for a in range(3):     # every arm ages per step: a fresh try outweighs what was seen long ago
            self.tokens[k][a] *= RATE_DECAY
            self.seconds[k][a] *= RATE_DECAY
        self.tokens[k][arm] += committed
        self.seconds[k][arm] += seconds
        if self._tried is not None:           # a try of another arm: confirmed, wait longer
            confirmed = self.best(k) == self._tried
            self.every[k] = min(2 * self.every[k], EXPLORE_MAX) if confirmed else EXPLORE_EVERY
