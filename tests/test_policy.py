"""Drafting that calibrates itself: the cost model, the per-step drafting and depth, and that an
adaptive engine stays lossless while its choices change step by step."""
import dataclasses
import json
import math

import pytest
import torch

import graft_tk
from graft_tk.acceptance import LEARNT_PRIOR_WEIGHT, PRIOR_WEIGHT, SCORE_EDGES, AcceptancePriors, SourcePriors
from graft_tk.calibration.cost import interpolate, measure_step_cost
from graft_tk.config import GraftConfig
from graft_tk.cost import StepCost
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.errors import CorruptFileError, InputError
from graft_tk.methods import METHODS
from graft_tk.ops import ops_for
from graft_tk.sources.prompt_lookup import NGRAM_CLASSES
from graft_tk.policy import (EXPLORE_EVERY, EXPLORE_MAX, DraftGate, Observation, PlainCheck, RankedValues, StepPlan,
                             StepPolicy)
from graft_tk.state import FIXED, SpecState
from graft_tk.profiles import profile_key, read_profile, write_profile

from .conftest import real_prompts

# A steep verify (10 ms + 2 ms per extra node) and a drafter forward of 0.25 ms per token: on real
# prompts the chosen depth then changes from step to step.
STEEP = StepCost(verify_ms=tuple(10.0 + 2 * (n - 1) for n in range(1, 17)),
                 draft_ms=tuple(0.25 * w for w in range(1, 17)), step_ms=1.0)


@pytest.fixture(scope="module")
def self_drafter():
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=10, progress=False)


# --------------------------------------------------------------------------- cost model
def test_interpolate_is_linear_between_points_flat_after_and_never_decreasing():
    assert interpolate({1: 10.0, 3: 14.0}, 4) == (10.0, 12.0, 14.0, 14.0)
    assert interpolate({1: 10.0, 2: 8.0, 4: 20.0}, 4) == (10.0, 10.0, 14.0, 20.0)   # noise dip removed


def test_step_cost_checks_its_curves_and_the_budget_it_covers():
    with pytest.raises(InputError, match="verify_ms must be positive"):
        StepCost(verify_ms=(1.0, -2.0), draft_ms=(), step_ms=0.0)
    with pytest.raises(InputError, match="empty"):
        StepCost(verify_ms=(), draft_ms=(), step_ms=0.0)
    with pytest.raises(InputError, match="fewer than budget 16"):
        GraftConfig(cost=StepCost(verify_ms=(1.0, 2.0), draft_ms=(), step_ms=0.0))
    assert GraftConfig(budget=2, cost={"verify_ms": [1, 2], "draft_ms": [], "step_ms": 0.5}).cost == StepCost(
        verify_ms=(1.0, 2.0), draft_ms=(), step_ms=0.5)
    assert STEEP.draft(20) == pytest.approx(4.0 * 20 / 16)     # past the curve: scaled by width


# --------------------------------------------------------------------------- decisions
def test_depth_threshold_is_the_lowest_score_whose_acceptance_pays_for_a_forward():
    cost = StepCost(verify_ms=(10.0,), draft_ms=(1.0, 2.0, 3.0, 4.0), step_ms=0.0)
    policy = StepPolicy(cost, top_k=4)                                 # R = 0.1, a K-wide forward 4 ms
    rates = [0.05 * b + 0.001 for b in range(len(SCORE_EDGES) + 1)]     # p_min = 0.4: bucket 8 first pays
    assert policy.depth_log_tau(rates, SCORE_EDGES, -math.inf) == SCORE_EDGES[7]
    assert policy.depth_log_tau(rates, SCORE_EDGES, math.log(0.9)) == math.log(0.9)   # tau stays a bound
    assert policy.depth_log_tau([0.1] * len(rates), SCORE_EDGES, -math.inf) == math.inf
    policy.count(committed=5, verified=1, draft_widths=(4,), drafted=True, drafted_accepted=3)   # raises R ...
    assert policy.rate == pytest.approx((0.95 * 4 + 5) / (0.95 * 40 + 10 + 4))
    assert policy.depth_log_tau(rates, SCORE_EDGES, -math.inf) > SCORE_EDGES[7]   # ... and the bar
    # where each verified node costs a row (1 ms here), the frontier's best must pay for its row too:
    # p_min = 0.1 * (4 + 1), bucket 10 first pays
    steep = StepPolicy(dataclasses.replace(cost, verify_ms=(10.0, 11.0, 12.0, 13.0, 14.0)), top_k=4, budget=5)
    assert steep.row_ms == 1.0 and steep.depth_log_tau(rates, SCORE_EDGES, -math.inf) == SCORE_EDGES[9]
    # a tree of 3 nodes takes 2 drafted children at most, so the step drafts 2 wide and the forward
    # is priced at 2 rows (2 ms): p_min = 0.1 * (2 + 1), bucket 6 first pays
    narrow = StepPolicy(dataclasses.replace(cost, verify_ms=(10.0, 11.0, 12.0)), top_k=4, budget=3)
    assert narrow.top_k == 2 and narrow.depth_log_tau(rates, SCORE_EDGES, -math.inf) == SCORE_EDGES[5]


def test_drafting_stops_where_the_drafted_nodes_rows_cost_more_than_they_add():
    flat = StepCost(verify_ms=(10.0,) * 16, draft_ms=(1.0,) * 16, step_ms=0.0)
    steep = dataclasses.replace(flat, verify_ms=tuple(10.0 * n for n in range(1, 17)))   # a row = a forward
    choices = {}
    for name, cost in (("flat", flat), ("steep", steep)):
        policy = StepPolicy(cost, top_k=1, budget=16)
        for _ in range(30):    # each drafting step: 2 forwards, 6 drafted nodes verified, 2 accepted
            policy.count(committed=3, verified=7, draft_widths=(1, 1), drafted=True, drafted_accepted=2,
                           drafted_verified=6)
        choices[name] = policy.should_draft()
    assert choices == {"flat": True, "steep": False}


def test_the_verify_takes_the_likeliest_nodes_that_pay_for_their_rows():
    likely = [math.log(0.9), math.log(0.5), math.log(0.5), -math.inf]       # best first, padding last
    steep = StepPolicy(StepCost(verify_ms=(10.0, 10.0, 10.0, 20.0, 20.0), draft_ms=(), step_ms=0.0), top_k=1)
    assert steep.rate == pytest.approx(0.1)
    assert steep.verify_width(likely) == 3              # the 4th node adds 0.5 tokens for 10 ms * R = 1
    flat = StepPolicy(StepCost(verify_ms=(10.0,) * 5, draft_ms=(), step_ms=0.0), top_k=1)
    assert flat.verify_width(likely) == 4               # every node with a chance; not the padding
    assert flat.verify_width([]) == 1
    rising = StepPolicy(StepCost(verify_ms=(10.0, 11.0, 12.0, 13.0), draft_ms=(), step_ms=0.0), top_k=1)
    assert rising.verify_width([math.log(0.01)] * 3) == 1     # 0.01 tokens do not pay for 1 ms * R = 0.1
    assert StepPolicy(StepCost(verify_ms=(10.0,) * 2, draft_ms=(), step_ms=0.0), top_k=1).verify_width(likely) == 2


def test_a_verify_costs_more_after_a_longer_context_and_the_policy_narrows_it():
    cost = StepCost(verify_ms=(10.0, 10.0, 10.0, 10.0), draft_ms=(), step_ms=0.0, context=256,
                    verify_ms_per_1k=(0.0, 2.0, 4.0, 6.0))
    assert cost.at(100) is cost and cost.at(256) is cost            # never assumed cheaper than measured
    assert cost.at(2256).verify_ms == (10.0, 14.0, 18.0, 22.0) and cost.at(2256).context == 2256
    policy = StepPolicy(cost, top_k=1, budget=4)
    likely = [math.log(0.9), math.log(0.5), math.log(0.2)]
    widths = {}
    for context in (256, 4256):
        policy.at_context(context)
        widths[context] = policy.verify_width(likely)
    assert widths == {256: 4, 4256: 2}, widths       # at 4k the 3rd node costs 8 ms more: 0.5 < 0.1 * 8
    with pytest.raises(InputError, match="verify_ms_per_1k must be 4 non-negative"):
        StepCost(verify_ms=(1.0,) * 4, draft_ms=(), step_ms=0.0, verify_ms_per_1k=(1.0, -1.0, 0.0, 0.0))
    assert GraftConfig(budget=2, cost={"verify_ms": [1, 2], "draft_ms": [], "step_ms": 0.5,
                                       "verify_ms_per_1k": [0.5, 1]}).cost.verify_ms_per_1k == (0.5, 1.0)


def test_the_knee_is_the_widest_verify_within_its_ratio_of_one_token():
    cost = StepCost(verify_ms=(10.0, 10.5, 12.0, 15.0, 15.1, 30.0), draft_ms=(), step_ms=0.0)
    assert cost.knee() == 4 and cost.knee(ratio=1.2) == 3 and cost.knee(ratio=1.0) == 1 and cost.knee(3.0) == 6


def test_drafting_is_skipped_while_it_does_not_pay_and_retried_less_often_while_it_still_does_not():
    cost = StepCost(verify_ms=(10.0,), draft_ms=(8.0,), step_ms=0.0)
    policy = StepPolicy(cost, top_k=1)
    assert policy.should_draft()                     # prior: one accepted drafted node per step >= 0.1 * 8
    for _ in range(20):                              # the drafter's nodes are never accepted
        policy.count(committed=1, verified=1, draft_widths=(1,), drafted=True, drafted_accepted=0)

    def steps(n: int, accepted: int = 0) -> list[bool]:
        choices = []
        for _ in range(n):
            choices.append(policy.should_draft())
            policy.count(committed=1 + accepted * choices[-1], verified=1, draft_widths=(1,) if choices[-1] else (),
                         drafted=choices[-1], drafted_accepted=accepted * choices[-1])
        return choices
    tries = [i for i, c in enumerate(steps(EXPLORE_MAX * 2 + 64), 1) if c]
    waits = [b - a for a, b in zip([0] + tries, tries)]
    assert waits[:4] == [EXPLORE_EVERY, 2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, EXPLORE_MAX] and set(waits[4:]) == {EXPLORE_MAX}
    assert all(steps(2 * EXPLORE_MAX, accepted=20)[-8:])     # the drafter pays again: it drafts every step
    assert policy.explore_every == EXPLORE_EVERY


def test_the_gate_takes_the_faster_of_drafting_or_not_in_each_situation():
    """Situations by prompt lookup's expected tokens: none (< 1), a match (1-4), a copy (>= 4). In
    each the gate takes what usually wins there until both arms are measured (drafting; not in a
    copy), then the faster; the other arm every EXPLORE_EVERY-th step of that situation at first."""
    def run(gate, free, steps, rate):      # rate[drafted]: (committed, seconds) of such a step
        picks = []
        for _ in range(steps):
            picks.append(gate.drafts(free=free))
            gate.count(*rate[picks[-1]], arm=int(picks[-1]))
        return picks
    explored = [False] * (EXPLORE_EVERY - 1) + [True]
    gate = DraftGate()
    faster_without = {True: (6, 0.6), False: (5, 0.2)}     # 10 vs 25 tokens/s
    assert run(gate, 3.0, EXPLORE_EVERY, faster_without) == [not x for x in explored]   # a match: drafting first
    assert run(gate, 3.0, EXPLORE_EVERY, faster_without) == explored                    # measured: without
    faster_drafting = {True: (6, 0.6), False: (1, 0.2)}    # 10 vs 5 tokens/s
    assert run(gate, 0.0, EXPLORE_EVERY, faster_drafting) == [not x for x in explored]   # none: drafting
    copy = run(gate, 6.0, EXPLORE_EVERY - 1, faster_drafting)
    assert copy == [False] * (EXPLORE_EVERY - 1)           # a copy of a few steps never drafts
    assert run(gate, 6.0, 1, faster_drafting) == [True]    # ... the EXPLORE_EVERY-th step tries it
    assert run(gate, 6.0, 1, faster_drafting) == [True]    # measured: drafting is faster here
    assert run(gate, 3.0, 1, faster_without) == [False]    # each situation keeps its own choice


def test_a_drafter_that_read_nothing_yet_waits_while_the_free_sources_match():
    """A drafter model reads its window in its first drafting step: while prompt lookup matches
    (a match or a copy) that read waits; with no match the drafter starts as usual."""
    gate = DraftGate()
    assert gate.drafts(free=3.0) and not gate.drafts(free=3.0, unread=True)   # a match: drafting first, unless unread
    assert not gate.drafts(free=6.0, unread=True)
    assert gate.drafts(free=0.0, unread=True)                                  # no match: the drafter starts
    plan = dataclasses.replace(StepPlan.fixed([METHODS["graft"]], GraftConfig()), unread=(True,))
    assert gate.plan(plan, torch.tensor([3.0])).drafts == (False,)
    assert gate.plan(dataclasses.replace(plan, unread=(False,)), torch.tensor([3.0])).drafts == (True,)


def test_the_gate_tries_the_other_arm_less_often_while_it_keeps_losing():
    """Each try that confirms the choice doubles the wait before the next (up to EXPLORE_MAX
    steps); a try that finds the other arm faster switches to it and the wait starts again."""
    gate = DraftGate()

    def tries(steps, rate):       # the steps (1-based) that took the arm not taken
        picks = []
        for _ in range(steps):
            picks.append(gate.drafts(free=6.0))            # a copy: not drafting first
            gate.count(*rate[picks[-1]], arm=int(picks[-1]))
        return [i + 1 for i, p in enumerate(picks) if p]
    faster_without = {True: (6, 0.6), False: (16, 0.4)}
    assert tries(8 + 16 + 32 + 64 + 56, faster_without) == [8, 24, 56, 120]
    assert gate.every[2] == EXPLORE_MAX
    faster_drafting = {True: (16, 0.2), False: (16, 0.4)}   # the workload changes: drafting pays now
    assert tries(8, faster_drafting) == [8]             # the next try, 64 steps after the last, ...
    assert gate.every[2] == EXPLORE_EVERY and gate.best(2) == DraftGate.DRAFTING   # ... finds drafting faster: one fresh try outweighs
    assert tries(EXPLORE_EVERY, faster_drafting) == list(range(1, EXPLORE_EVERY))   # the old; not drafting tried at 8


def test_a_copy_is_verified_as_far_as_it_is_likely_while_that_is_faster():
    """In a copy the gate's first arm verifies wide: the plan's budget is the copy budget, the
    width the nodes at least WIDE_P likely (at least N, at most the copy budget); it counts as
    its own arm, and where the N-node verify turns out faster the gate takes that."""
    gate = DraftGate(wide=64)
    plan = StepPlan.fixed([METHODS["graft"]], GraftConfig(budget=16))
    wide = gate.plan(plan, torch.tensor([20.0]))
    assert wide.budget == 64 and wide.drafts == (False,)
    values = torch.full((1, 64), -math.inf)
    values[0, :41] = math.log(0.6)                        # the root and 40 likely nodes
    assert gate.width(wide, RankedValues(values)) == 41
    assert gate.width(wide, RankedValues(values[:, :5])) == 16      # never narrower than N
    gate.observe(wide, Observation(30, 1.0, 41, (), False, 0, 0))
    assert gate.tokens[2][DraftGate.WIDE] == 30 and gate.best(2) == DraftGate.WIDE
    assert gate.width(plan, RankedValues(values)) == 16   # a narrow plan stays narrow
    picks = []
    for _ in range(EXPLORE_EVERY):
        arm = gate.arm(free=20.0)
        picks.append(arm)
        gate.count(*{DraftGate.WIDE: (30, 1.0), DraftGate.NARROW: (16, 0.4), DraftGate.DRAFTING: (6, 0.6)}[arm], arm=arm)
    assert picks == [DraftGate.WIDE] * (EXPLORE_EVERY - 2) + [DraftGate.NARROW, DraftGate.NARROW]   # tried: faster
    assert DraftGate().arms[2] == (DraftGate.NARROW, DraftGate.DRAFTING)    # no copy budget: no wide arm


def test_a_batch_costs_its_rows_tokens_and_extends_the_curve_by_its_slope():
    cost = StepCost(verify_ms=(10.0, 10.0, 12.0, 14.0), draft_ms=(1.0, 2.0), step_ms=1.0, verify_ms_per_1k=(1.0,) * 4)
    assert cost.batch(1) is cost
    two = cost.batch(2)
    assert two.verify_ms == (10.0, 14.0, 18.0, 22.0)         # 2, 4 tokens measured; 6, 8 at 2 ms a token
    assert two.draft_ms == (2.0, cost.draft(4))
    assert two.step_ms == 1.0 and len(two.verify_ms_per_1k) == 4


def test_a_verify_carrying_a_prompt_chunk_costs_what_its_nodes_add_to_the_chunks_forward():
    """A step whose forward reads a prompt's chunk of c tokens (riding) pays for its rows' nodes
    only what they add to that forward: the curve at c + rows x n minus the curve at c."""
    cost = StepCost(verify_ms=(10.0, 10.0, 12.0, 14.0), draft_ms=(1.0, 2.0), step_ms=1.0, verify_ms_per_1k=(1.0,) * 4)
    riding = cost.batch(2, riding=2)
    assert riding.verify_ms == (4.0, 8.0, 12.0, 16.0)     # curve(4, 6, 8, 10) - curve(2) = 14 - 10, 18 - 10, ...
    assert cost.batch(1, riding=1).verify_ms[0] == pytest.approx(1e-3)   # a flat curve adds nothing: still positive
    assert riding.draft_ms == cost.batch(2).draft_ms


def test_a_step_carrying_a_chunk_is_neither_a_try_nor_counted_and_verifies_by_its_added_cost():
    """Its seconds are mostly the chunk's: the plain check takes the situation's best arm without
    counting it or trying the other; the cost policy leaves its rate alone and prices the nodes at
    what they add to the chunk's forward: where a verify alone is flat (its weight read), they are
    no longer free."""
    plan = StepPlan.fixed([METHODS["graft"]] * 4, GraftConfig())
    check, none = PlainCheck(), torch.zeros(4)
    for _ in range(2 * EXPLORE_EVERY):      # speculation slower than plain decoding: plain, tries aside
        p = check.plan(plan, none)
        check.observe(p, Observation(*((4, 0.2) if p.budget == 1 else (5, 0.28)), p.budget, (), False, 0, 0))
    assert check.best() == PlainCheck.PLAIN
    since, counts = list(check.since), [list(c) for c in (check.plain, *check.speculating)]
    riding = dataclasses.replace(plan, riding=256)
    for _ in range(3 * EXPLORE_EVERY):      # never a try of speculation, never counted
        p = check.plan(riding, none)
        assert p.budget == 1
        check.observe(p, Observation(100, 0.01, 1, (), False, 0, 0))
    assert check.since == since and [list(c) for c in (check.plain, *check.speculating)] == counts
    # a forward flat to 8 tokens, then 2 ms a token: 2 rows alone verify 4 nodes each for the
    # price of one; carrying 256 prompt tokens every node costs 2 ms, more than a 0.3 node brings
    cost = StepCost(verify_ms=tuple(10.0 + 2 * max(n - 8, 0) for n in range(1, 17)), draft_ms=(), step_ms=0.0)
    two = StepPlan.fixed([METHODS["graft"]] * 2, GraftConfig())
    policy = StepPolicy(cost, top_k=1, budget=16, rows=2)
    unlikely = RankedValues(torch.full((2, 16), math.log(0.3)))
    alone = policy.width(policy.plan(two, None), unlikely)
    rate = policy.rate
    riding = dataclasses.replace(two, riding=256)
    carrying = policy.width(policy.plan(riding, None), unlikely)
    policy.observe(riding, Observation(400, 1e-3, carrying, (), False, 0, 0))
    assert (alone, carrying) == (4, 1) and policy.rate == rate and policy.cost.verify_ms == policy.measured.verify_ms


def test_drafting_that_lowers_the_rate_below_plain_decodings_does_not_confirm_itself():
    """R never falls below plain decoding's rate: drafting steps whose accepted nodes only pay at
    their own lowered rate stop. (4 rows on a 2-core CPU: ~9 drafted nodes accepted for ~700 ms
    a step, 12 tokens/s where plain decoding makes 20, drafted every step while R followed them down.)"""
    cost = StepCost(verify_ms=(200.0,) * 16, draft_ms=(30.0, 60.0, 90.0, 120.0), step_ms=0.0)
    policy = StepPolicy(cost, top_k=4, budget=16, rows=4)
    assert policy.rate == pytest.approx(4 / 200)
    drafted = []
    for _ in range(12 * EXPLORE_EVERY):        # each drafting step: 6 forwards of 4 x 4 nodes, 9 drafted nodes accepted
        may = policy.may_draft()                # (what lets a row's drafter read its prompt before the step)
        drafted.append(policy.should_draft())
        assert may == drafted[-1]
        policy.count(committed=13 if drafted[-1] else 4, verified=1, draft_widths=(4,) * 6 if drafted[-1] else (),
                     drafted=drafted[-1], drafted_accepted=9 if drafted[-1] else 0)
        assert policy.rate >= 4 / 200
    # a batch waits for its first try, 4 rows 4 x EXPLORE_EVERY steps; the try does not pay (9 nodes
    # < R x 720 ms = 14.4), so the next waits twice as long
    assert [i for i, d in enumerate(drafted) if d] == [4 * EXPLORE_EVERY - 1, 12 * EXPLORE_EVERY - 1]


def test_a_batch_speculates_only_as_far_as_its_measured_costs_pay():
    """Flat to 4 tokens, then 2 ms a token: one request verifies wide; four requests, whose
    one-more-node-each costs 4 tokens of forward, verify nothing but their roots unless the
    nodes are likely enough (plain decoding is one of the choices)."""
    cost = StepCost(verify_ms=tuple(10.0 + 2 * max(n - 4, 0) for n in range(1, 17)), draft_ms=(), step_ms=0.0)
    plan = StepPlan.fixed([METHODS["graft"]] * 4, GraftConfig(budget=16))
    half = torch.full((4, 16), math.log(0.5))
    alone = StepPolicy(cost, top_k=1, budget=16)
    assert alone.width(plan, RankedValues(half[:1])) == 16              # 0.5 tokens a node for 2 ms at R = 0.1
    batch = StepPolicy(cost, top_k=1, budget=16, rows=4)
    assert batch.rate == pytest.approx(0.4)                # plain decoding: 4 tokens per 10 ms
    assert batch.width(plan, RankedValues(half)) == 1                    # 4 x 0.5 tokens < 0.4 x 8 ms
    assert batch.width(plan, RankedValues(torch.full((4, 16), math.log(0.9)))) > 1      # 4 x 0.9 > 3.2
    mixed = half.clone()
    mixed[2:] = -math.inf                                  # two rows without candidates add nothing
    assert batch.width(plan, RankedValues(mixed)) == 1


def test_a_batch_decodes_plainly_while_plain_decoding_commits_more_per_second():
    plan = StepPlan.fixed([METHODS["graft"]] * 4, GraftConfig())
    check = PlainCheck()
    none = torch.zeros(4)

    def run(steps: int, speculating: tuple[int, float], plain: tuple[int, float], free: torch.Tensor = none) -> list[int]:
        """``steps`` steps, each counted at its arm's (tokens, seconds); the budgets they verified."""
        budgets = []
        for _ in range(steps):
            p = check.plan(plan, free)
            best = check.best()
            assert p.budget in (1, plan.budget) and (p.budget > 1 or not p.drafting)
            assert p.drafting == (p.budget > 1 and best == PlainCheck.SPECULATE)   # a try of it does not draft
            committed, seconds = plain if p.budget == 1 else speculating
            check.observe(p, Observation(committed, seconds, p.budget, (), p.drafting, 0, 0))
            budgets.append(p.budget)
        return budgets
    # speculation slower (4.8 tokens per 0.28 s against 4 per 0.2 s): it is dropped after the
    # first try of plain decoding, then tried again every 8, 16, 32, 64 steps
    budgets = run(200, (5, 0.28), (4, 0.2))
    assert budgets[:EXPLORE_EVERY - 1] == [16] * (EXPLORE_EVERY - 1) and budgets[EXPLORE_EVERY - 1] == 1
    tries = [i for i, b in enumerate(budgets) if b > 1 and i >= EXPLORE_EVERY]
    assert [b - a for a, b in zip(tries, tries[1:])][:4] == [16, 32, 64, 64]
    assert not check.may_draft() and check.best() == PlainCheck.PLAIN
    # a copy (the rows' free tokens summed >= 4) is a situation of its own: it speculates from its
    # first step, while plain decoding's rate, measured in the others, is the one it compares with
    copy = torch.tensor([0.0, 6.0, 0.0, 0.0])
    budgets = run(40, (9, 0.28), (4, 0.2), free=copy)
    assert check.situation == 2 and check.best() == PlainCheck.SPECULATE and check.may_draft()
    assert budgets.count(1) <= 40 // EXPLORE_EVERY and budgets[0] == 16
    assert check.best(0) == PlainCheck.PLAIN                  # where nothing copies, plain as learnt
    # the batch's speculation becomes faster where nothing copies: its next try brings it back
    budgets = run(150, (9, 0.28), (4, 0.2))
    assert check.best() == PlainCheck.SPECULATE and check.may_draft()
    assert budgets[-8:].count(1) <= 1 and max(check.every) <= EXPLORE_MAX
    ar = StepPlan.fixed([METHODS["ar"]] * 4, GraftConfig())
    assert check.plan(ar, copy).budget == 1                  # nothing to decide


def test_a_batch_believes_its_estimates_as_far_as_its_nodes_are_accepted():
    """A batch whose verified nodes get a fifth of what their estimates say verifies narrower (the
    same values no longer pay for a wider verify); with nothing to check them against for a while
    it believes them again. A request alone believes its estimates as they are."""
    cost = StepCost(verify_ms=tuple(10.0 + 2 * max(n - 4, 0) for n in range(1, 17)), draft_ms=(), step_ms=0.0)
    plan = StepPlan.fixed([METHODS["graft"]] * 4, GraftConfig(budget=16))
    likely = RankedValues(torch.full((4, 16), math.log(0.9)))
    batch = StepPolicy(cost, top_k=1, budget=16, rows=4)
    wide = batch.width(plan, likely)
    assert batch.belief == 1.0 and wide > 1

    def observe(policy: StepPolicy, expected: float, accepted: int, verified: int = 4) -> None:
        policy.observe(plan, Observation(4 + accepted, 0.1, verified, (), False, 0, 0, None, expected, accepted))
    for _ in range(30):
        observe(batch, expected=3.0, accepted=0)
    assert batch.belief < 0.2 and batch.width(plan, likely) < wide
    for _ in range(60):
        observe(batch, expected=3.0, accepted=3)
    assert batch.belief > 0.9
    for _ in range(30):
        observe(batch, expected=3.0, accepted=0)
    for _ in range(200):                    # plain steps: nothing expected, nothing accepted
        observe(batch, expected=0.0, accepted=0, verified=1)
    assert batch.belief > 0.9
    alone = StepPolicy(cost, top_k=1, budget=16)
    for _ in range(30):
        observe(alone, expected=3.0, accepted=0)
    assert alone.belief == 1.0


def test_the_fixed_plan_follows_the_config_and_each_rows_method():
    config = GraftConfig(budget=3, max_depth=6, top_k=4, tau=0.5)
    plan = StepPlan.fixed([METHODS["ar"], METHODS["graft"], METHODS["tree"], METHODS["pld"]], config)
    assert (plan.budget, plan.depth, plan.top_k) == (3, 2, 2)     # no deeper or wider than 3 nodes verify
    assert plan.drafts == (False, True, True, False) and plan.drafting
    assert plan.log_tau == (-math.inf, math.log(0.5), -math.inf, -math.inf)    # only graft prunes
    alone = StepPlan.fixed([METHODS["ar"]], config)
    assert alone.budget == 1 and not alone.drafting            # plain decoding: the root alone


def test_the_state_chooses_a_requests_controllers_and_a_batch_runs_its_config():
    state = SpecState(GraftConfig(cost=STEEP), ops_for("torch", "cpu"), "cpu", vocab_size=64)
    plain = SpecState(GraftConfig(), ops_for("torch", "cpu"), "cpu", vocab_size=64)
    for s in (state, plain):
        s.admit(METHODS["graft"])
    assert state.controller([METHODS["graft"]]).parts == (state.gate, state.policy)   # prompt lookup signals
    assert state.controller([METHODS["graft-paper"]]).parts == (state.policy,)
    assert plain.controller([METHODS["graft"]]).parts == (plain.gate,)
    assert plain.controller([METHODS["graft-paper"]]) is FIXED
    assert state.controller([METHODS["tree"]]) is FIXED                            # it does not prune
    two = state.controller([METHODS["graft"]] * 2)          # a batch: the cost policy of its size, held to plain's rate
    check, policy = two.parts
    assert isinstance(policy, StepPolicy) and policy.rows == 2 and isinstance(check, PlainCheck)
    assert state.controller([METHODS["graft"]] * 2) is two
    assert plain.controller([METHODS["graft"]] * 2) is FIXED               # no cost model: its config
    assert state.controller([METHODS["tree"], METHODS["pld"]]) is FIXED    # no row prunes
    # the gate reads the free sources' signal only when the row would draft, and learns only then
    gate, plan = DraftGate(), StepPlan.fixed([METHODS["graft"]], GraftConfig())
    assert gate.plan(plan, torch.tensor([3.0])).drafts == (True,)     # a match: drafting first
    gate.observe(plan, Observation(6, 0.6, 16, (4,), True, 5, 8))
    assert gate.seconds[1][1] == 0.6 and gate.tokens[1][1] == 6       # the step it asked for is counted
    assert gate.plan(plan, torch.tensor([6.0])).drafts == (False,)    # a copy: not drafting first
    undrafted = dataclasses.replace(plan, drafts=(False,))
    assert gate.plan(undrafted, torch.tensor([3.0])) is undrafted      # a row that would not draft: not asked
    gate.observe(undrafted, Observation(6, 0.6, 16, (4,), True, 5, 8))
    assert gate.seconds[1][0] == 0.0 and gate.seconds[2][0] == 0.0    # ... and nothing learnt


def test_graft_pld_skips_the_drafter_where_prompt_lookup_proposes_and_equals_ar(smollm2, self_drafter):
    """A list to repeat: prompt lookup proposes it, the (weak) drafter adds little, so most steps
    skip it; the tokens are ar's."""
    ids = encode_prompt(smollm2, "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, "
                                 "honeydew, kiwi, lemon, mango, nectarine. Now repeat it again:", chat=True)
    want = graft_tk.decode(smollm2, ids, max_new_tokens=48).tokens
    got = graft_tk.decode(smollm2, ids, drafter=self_drafter, method="graft", max_new_tokens=48)
    forwards = got.stats["per_step"]["drafter_forwards"]
    assert got.tokens == want
    assert forwards.count(0) > len(forwards) // 2 and max(forwards) > 0


# --------------------------------------------------------------------------- lossless while adapting
@pytest.mark.slow
@pytest.mark.parametrize("prompt", real_prompts(1, 0)[:1], ids=lambda p: getattr(p, "id", "x"))
def test_adaptive_methods_equal_ar_while_depth_and_width_change(smollm2, self_drafter, prompt):
    ids = encode_prompt(smollm2, prompt.text, chat=True)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=40)
    depths = set()
    for method in [m for m in METHODS if METHODS[m].prune]:
        engine = Engine(smollm2, self_drafter, GraftConfig(cost=STEEP, tau=0.01))
        got = graft_tk.decode(smollm2, ids, method=method, engine=engine, max_new_tokens=40)
        assert got.tokens == ref.tokens, method
        per_step = got.stats["per_step"]
        depths |= set(per_step["drafter_forwards"])
        assert max(per_step["drafter_forwards"]) <= GraftConfig().max_depth
        # the steep verify: each step verifies the nodes that pay for their rows, never past N
        assert len(set(per_step["nodes"])) > 1 and max(per_step["nodes"]) <= 16, (method, per_step)
        reads, forwards = got.stats["host_syncs_per_step"], got.stats["drafter_forwards_per_step"]
        gate = METHODS[method].uses("prompt_lookup")     # the draft gate's read
        # each step reads its outcome and its verify's width, each pruning depth its stop flags,
        # a step that asks the gate its signal: at most that many, and never less than the
        # outcome and the depths (a sync skipped would show here)
        assert 1 + forwards - 1e-9 <= reads <= 2 + gate + forwards + 1e-9, (method, reads, forwards)
    assert len(depths) > 1, depths     # the drafter ran on some steps, not on others


def test_a_dear_drafter_drafts_less(smollm2, self_drafter):
    ids = encode_prompt(smollm2, "Count from one to twenty: one, two, three,", chat=False)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=12)
    dear_drafter = StepCost(verify_ms=STEEP.verify_ms, draft_ms=tuple(3.0 * w for w in range(1, 17)), step_ms=1.0)
    engine = Engine(smollm2, self_drafter, GraftConfig(cost=dear_drafter, tau=0.01))
    got = graft_tk.decode(smollm2, ids, method="graft", engine=engine, max_new_tokens=12)
    assert got.tokens == ref.tokens
    fixed = graft_tk.decode(smollm2, ids, drafter=self_drafter, method="graft", max_new_tokens=12,
                            config=GraftConfig(tau=0.01))
    assert got.stats["drafter_forwards_per_step"] < fixed.stats["drafter_forwards_per_step"]


def test_stats_compare_estimated_and_observed_acceptance_per_source(smollm2, self_drafter):
    r = graft_tk.decode(smollm2, "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", chat=False,
                        drafter=self_drafter, method="graft", max_new_tokens=24)
    expected, nodes = r.stats["expected_accepted_by_source"], r.stats["nodes_by_source"]
    assert set(expected) == set(nodes)
    # each source's expectation is a sum of probabilities over its verified nodes
    assert all(0 < expected[s] <= nodes[s] for s in expected)


# --------------------------------------------------------------------------- measured and stored
@pytest.mark.slow
def test_cost_is_measured_stored_in_the_profile_and_makes_decode_adaptive(smollm2, self_drafter, tmp_path,
                                                                        monkeypatch):
    config = GraftConfig(budget=4)
    cost = measure_step_cost(smollm2, self_drafter, config, repeats=1)
    assert len(cost.verify_ms) == 4 and len(cost.draft_ms) == 4 and cost.step_ms > 0
    assert list(cost.verify_ms) == sorted(cost.verify_ms)
    # timed again 2,048 cached tokens further: attention over 8x the keys costs something
    assert len(cost.verify_ms_per_1k) == 4 and max(cost.verify_ms_per_1k) > 0
    path = write_profile(profile_key(smollm2, self_drafter), "graft", GraftConfig(budget=4, cost=cost), {},
                         tmp_path)
    assert read_profile(path).config.cost == cost
    monkeypatch.setenv("GRAFT_TK_PROFILE_DIR", str(tmp_path))
    r = graft_tk.decode(smollm2, "List three fruits.", drafter=self_drafter, method="graft", max_new_tokens=8)
    assert r.stats["config"]["cost"]["verify_ms"] == cost.verify_ms

    path.write_text(path.read_text().replace('"step_ms"', '"step_seconds"'))
    with pytest.raises(CorruptFileError, match="invalid contents"):
        read_profile(path)


def test_cost_only_measures_the_cost_and_learns_priors_into_the_profile(tmp_path, capsys):
    from graft_tk.cli.calibrate import main
    assert main(["--model", "smollm2-135m", "--drafter", "self:4", "--dtype", "fp32", "--cost-only",
                 "--prompts", "humaneval", "--n-prompts", "1", "--max-new-tokens", "12",
                 "--profile-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "acceptance priors:" in out
    (path,) = tmp_path.glob("*.json")
    profile = read_profile(path)
    priors, cost = profile.config.priors, profile.config.cost
    assert cost is not None and priors is not None
    # verifies measured up to 64 tokens; without a tuned profile N is the verify's knee
    assert len(cost.verify_ms) == 64 and profile.config.budget == cost.knee()
    draft = priors.draft.rates
    assert len(draft) == len(SCORE_EDGES) + 1 and list(draft) == sorted(draft)
    assert len(priors.of("adjacency").rates) == profile.config.retrieval_k
    assert len(priors.of("prompt_lookup").rates) == len(NGRAM_CLASSES)    # graft uses every source
    assert profile.measured["priors_prompts"] == ["HumanEval/0"]
    # the engine starts from them
    engine = Engine(graft_tk.load_model("smollm2-135m", dtype="fp32", progress=False), None, profile.config)
    assert torch.allclose(engine.state.draft_rates.rate(), torch.tensor(draft), atol=1e-6)


def test_learnt_priors_follow_the_counts_and_are_validated(smollm2):
    small = dict(retrieval_k=2, template=(2, 1), pld_tokens=3, pld_max_ngram=2, suffix_max_match=2)
    state = Engine(smollm2, None, GraftConfig(**small)).state
    state.set_decay(1.0)
    state.admit(METHODS["graft"])
    retrieval = state.source("adjacency").rates
    retrieval.n += torch.tensor([50.0, 50.0, 0.0])          # rank 0 always right, rank 1 never
    retrieval.acc += torch.tensor([50.0, 0.0, 0.0])
    learnt = state.learnt_priors()
    assert set(learnt.sources) == {"adjacency", "prompt_lookup", "suffix"}     # every source learns its own
    adjacency, pld, suffix = (learnt.of(name) for name in ("adjacency", "prompt_lookup", "suffix"))
    assert adjacency.rates[0] > 0.9 and adjacency.rates[1] < 0.05
    assert adjacency.weights == (LEARNT_PRIOR_WEIGHT, LEARNT_PRIOR_WEIGHT)
    # nothing seen: the generic guess, weighing no more than it did
    assert pld.rates == pytest.approx((0.3, 0.5)) and pld.weights == (PRIOR_WEIGHT, PRIOR_WEIGHT)
    assert suffix.rates == pytest.approx((0.3, 0.45)) and suffix.weights == (PRIOR_WEIGHT, PRIOR_WEIGHT)
    config = GraftConfig(**small, priors=json.loads(json.dumps(dataclasses.asdict(learnt))))   # a profile's round trip
    assert config.priors == learnt
    started = Engine(smollm2, None, config).state
    started.admit(METHODS["graft"])
    assert started.source("adjacency").rates.rate()[:2].tolist() == pytest.approx(adjacency.rates, rel=1e-5)
    assert started.source("suffix").learnt() == suffix       # the round trip holds for every source
    with pytest.raises(InputError, match="probabilities"):
        SourcePriors((0.0, 0.5), (2.0, 2.0))
    with pytest.raises(InputError, match="score buckets"):
        AcceptancePriors(SourcePriors((0.5,), (2.0,)))
    with pytest.raises(InputError, match="one weight"):
        SourcePriors((0.5, 0.5), (100.0, 2.0))


def test_a_long_copy_is_verified_wider_than_n_and_equals_ar(smollm2, self_drafter):
    """A file whose third copy the model writes: once prompt lookup's chain is a copy, steps
    verify up to the copy budget (64 nodes, accepted whole), and the tokens are ar's."""
    code = ("def merge(left, right):\n    out = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
            "        if left[i] <= right[j]:\n            out.append(left[i])\n            i += 1\n        else:\n"
            "            out.append(right[j])\n            j += 1\n    out.extend(left[i:])\n    out.extend(right[j:])\n"
            "    return out\n")
    ids = smollm2.tokenizer.encode(f"# merge.py\n{code}\n\n# merge_copy.py\n{code}\n\n# merge_copy2.py\n")
    want = graft_tk.decode(smollm2, ids, max_new_tokens=96).tokens
    got = graft_tk.decode(smollm2, ids, drafter=self_drafter, method="graft", max_new_tokens=96)
    assert got.tokens == want
    nodes, committed = got.stats["per_step"]["nodes"], got.stats["per_step"]["committed"]
    assert max(nodes) == GraftConfig().copy_budget > GraftConfig().budget and max(committed) > GraftConfig().budget
