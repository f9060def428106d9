"""Requests in flight (graft_tk.batch): joining and leaving between steps, the budget policy by batch
size. Every request's tokens equal decoding it alone with `ar` in fp32, on real prompts with real
SmolLM2 weights (the step itself, every method and B = 4: tests/test_engine.py)."""
import pytest
import torch

import graft_tk
import graft_tk.step
from graft_tk.batch import decode_batch
from graft_tk.bench.prompts import load_prompts
from graft_tk.config import GraftConfig
from graft_tk.cost import StepCost
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.methods import METHODS
from graft_tk.policy import PlainCheck


@pytest.fixture(scope="module")
def self_drafter():
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=10, progress=False)


@pytest.fixture(scope="module")
def prompts(smollm2):
    texts = [p.text for p in load_prompts("humaneval")[:2]] + ["Name three colours.", "Say hello in French."]
    return [encode_prompt(smollm2, text, chat=True) for text in texts]


def record_drafter_reads(monkeypatch, drafter, order: list[str] | None = None) -> list[tuple[int, bool, bool]]:
    """Every call of ``drafter.read`` from now on, as (row, inside a batch step?, did it read?);
    ``order`` gets "read", "draft" and "step" (a step's end) in the order they happen."""
    import graft_tk.batch
    stepping, calls, order = [False], [], [] if order is None else order
    real_step, real_read, real_draft = graft_tk.batch.decode_step, drafter.read, drafter.draft

    def decode_step(*args, **kwargs):
        stepping[0] = True
        try:
            return real_step(*args, **kwargs)
        finally:
            stepping[0] = False
            order.append("step")

    def read(row, *args):
        done = real_read(row, *args)
        calls.append((row, stepping[0], done))
        order.append("read")
        return done

    def draft(*args):
        order.append("draft")
        return real_draft(*args)
    monkeypatch.setattr(graft_tk.batch, "decode_step", decode_step)
    monkeypatch.setattr(drafter, "read", read)
    monkeypatch.setattr(drafter, "draft", draft)
    return calls


@pytest.fixture(scope="module")
def ar_alone(smollm2, prompts):
    return [graft_tk.decode(smollm2, ids, max_new_tokens=24).tokens for ids in prompts]


def test_requests_join_and_leave_between_steps(smollm2, self_drafter, prompts, ar_alone):
    """A short request leaves row 0; the long one moves into it with its KV; a third joins row 1."""
    batch = Engine(smollm2, self_drafter).batch(2)
    with torch.inference_mode():
        short = batch.add(prompts[0], "graft", max_new_tokens=3)
        long = batch.add(prompts[1], "graft", max_new_tokens=24)
        assert batch.rows == [short, long] and batch.full
        with pytest.raises(InputError, match="the batch is full"):
            batch.add(prompts[2], "graft", max_new_tokens=24)
        finished = []
        while short not in finished:
            finished += batch.step()
        assert batch.rows == [long]           # moved from row 1 to row 0
        third = batch.add(prompts[2], "graft", max_new_tokens=24)
        assert batch.rows == [long, third]
        while len(batch):
            finished += batch.step()
    assert short.out == ar_alone[0][:3]
    assert long.out == ar_alone[1]
    assert third.out == ar_alone[2]


@pytest.mark.parametrize("method", ["ar", "graft"])
def test_a_long_prompt_is_read_a_chunk_per_step_while_the_others_decode(smollm2, self_drafter, prompts, method,
                                                                        monkeypatch):
    """With prefill_chunk C a prompt that arrives while others decode is read by the next steps,
    C tokens each, in the row after theirs and in the same target forward as their verify, and
    joins them once read; the others commit tokens meanwhile, one
    of them leaves (the prompt's row moves down with it), and every answer is plain decoding's (fp32).
    A drafting batch's new row reads its drafter's prompt between steps, never inside one, and a
    step that reads a chunk or a drafter's prompt does not draft (the others' streams would wait
    for both)."""
    long_ids = encode_prompt(smollm2, "\n\n".join(p.text for p in load_prompts("humaneval")[:3]), chat=True)
    assert len(long_ids) > 3 * 64                            # several chunks of 64
    want = [graft_tk.decode(smollm2, ids, max_new_tokens=n).tokens
            for ids, n in ((prompts[2], 24), (prompts[3], 4), (long_ids, 16))]
    batch = Engine(smollm2, self_drafter).batch(3, prefill_chunk=64)
    order: list[str] = []
    calls = record_drafter_reads(monkeypatch, batch.runtime.drafter, order)
    real_parts = graft_tk.step.Prefill.parts
    monkeypatch.setattr(graft_tk.step.Prefill, "parts", lambda *a: (order.append("chunk"), real_parts(*a))[1])
    with torch.inference_mode():
        staying = batch.add(prompts[2], method, max_new_tokens=24)     # nothing decodes: read at once
        leaving = batch.add(prompts[3], method, max_new_tokens=4)      # read by the next step
        assert batch.rows == [staying] and batch.prefilling.request is leaving and batch.full
        finished = batch.step()
        assert batch.rows == [staying, leaving] and batch.prefilling is None and not batch.full
        reading = batch.add(long_ids, method, max_new_tokens=16)
        assert batch.prefilling.request is reading and batch.prefilling.tokens_read == 0 and len(batch) == 3
        chunks, running = 0, leaving not in finished
        net, forwards = smollm2.net, []
        real_forward, real_packed = net.forward, net.forward_packed
        monkeypatch.setattr(net, "forward", lambda *a, **k: (forwards.append("forward"), real_forward(*a, **k))[1])
        monkeypatch.setattr(net, "forward_packed", lambda *a, **k: (forwards.append("packed"), real_packed(*a, **k))[1])
        while batch.prefilling is not None:
            before, forwards[:] = len(staying.out), []
            finished += batch.step()
            chunks += 1
            assert len(staying.out) > before                 # it decodes while the prompt is read
            assert forwards == ["packed"]                    # ONE target forward: the rows' verify and the chunk
        assert chunks == -(-len(long_ids) // 64) and leaving in finished
        assert running or method != "ar"                     # ar: one token a step, so it left mid-read
        assert batch.rows == [staying, reading] and len(reading.out) >= 1
        while len(batch):
            finished += batch.step()
    assert [staying.out, leaving.out, reading.out] == want
    # graft: every drafter read between two steps, and no step drafts right after a read or a chunk
    assert (calls and not any(inside for _, inside, _ in calls)) if method == "graft" else calls == []
    after_read = [order[i + 1] for i, e in enumerate(order[:-1]) if e in ("read", "chunk")]
    assert order.count("chunk") >= chunks and after_read and "draft" not in after_read
    assert ("draft" in order) == (method == "graft")


def test_every_method_equals_ar_with_a_prompt_read_in_chunks_beside_three_decoding(smollm2, self_drafter, prompts):
    """fp32, B = 4: three requests decode while a prompt of several 64-token chunks is read in
    their steps' forwards; every method's answers are plain decoding's, each request alone."""
    long_ids = encode_prompt(smollm2, "\n\n".join(p.text for p in load_prompts("humaneval")[:2]), chat=True)
    assert len(long_ids) > 2 * 64
    ids, lengths = [prompts[2], prompts[3], prompts[0], long_ids], [32, 32, 32, 8]
    want = [graft_tk.decode(smollm2, i, max_new_tokens=n).tokens for i, n in zip(ids, lengths)]
    engine = Engine(smollm2, self_drafter)
    for method in METHODS:
        batch = engine.batch(4, prefill_chunk=64)
        with torch.inference_mode():
            requests = [batch.add(ids[0], method, max_new_tokens=lengths[0])]
            for i, n in zip(ids[1:], lengths[1:]):    # each read beside those decoding, as a server admits them
                while batch.full:
                    batch.step()
                requests.append(batch.add(i, method, max_new_tokens=n))
            assert batch.prefilling is not None and len(batch.rows) == 3
            while len(batch):
                batch.step()
        assert [r.out for r in requests] == want, method


def test_m_warms_from_a_prompt_as_its_chunks_are_read(smollm2, prompts):
    """A prompt read in chunks beside a decoding row fills M's rows for each chunk's tokens in the
    step that reads it, before the rest of the prompt is read (the row decoding uses prompt lookup
    only: it writes nothing to M)."""
    long_ids = encode_prompt(smollm2, "\n\n".join(p.text for p in load_prompts("humaneval")[:2]), chat=True)
    engine = Engine(smollm2)
    M = None
    batch = engine.batch(2, prefill_chunk=64)
    with torch.inference_mode():
        batch.add(prompts[0], "pld", max_new_tokens=48)
        batch.add(long_ids, "retrieval", max_new_tokens=4)
        M = engine.state.source("adjacency").matrix
        assert (M == -1).all()
        batch.step()
        assert batch.prefilling is not None and batch.prefilling.tokens_read == 64
        window = len(long_ids) - engine.config.warm_window       # M warms from the prompt's last positions
        assert 0 <= window < 64
        first, rest = set(long_ids[window:64]), set(long_ids[64:]) - set(long_ids[:64])
        assert all((M[t] >= 0).all() for t in first) and rest and all((M[t] == -1).all() for t in rest)
        while len(batch):
            batch.step()
        assert all((M[t] >= 0).all() for t in rest)


def test_prefill_seconds_cuts_a_chunk_to_what_the_last_reads_say_fits(smollm2, prompts):
    """With prefill_seconds a step reads at most what the batch's measured read rate reads in that
    time (the nearest multiple of 32 tokens, at least 32, at most prefill_chunk); before any read is timed,
    prefill_chunk. The answer is still plain decoding's (fp32)."""
    long_ids = encode_prompt(smollm2, "\n\n".join(p.text for p in load_prompts("humaneval")[:3]), chat=True)
    want = graft_tk.decode(smollm2, long_ids, max_new_tokens=4).tokens
    for seconds, chunk in ((1e-6, 32), (1e6, 128)):
        batch = Engine(smollm2).batch(2, prefill_chunk=128, prefill_seconds=seconds)
        assert batch.chunk() == 128 and batch.read_rate is None
        with torch.inference_mode():
            first = batch.add(long_ids, "ar", max_new_tokens=40)     # read whole: its read is timed
            assert batch.read_rate > 0 and batch.chunk() == chunk
            second = batch.add(long_ids, "ar", max_new_tokens=4)
            read = []
            while batch.prefilling is not None:
                read.append(batch.prefilling.tokens_read)
                batch.step()
            while len(batch):
                batch.step()
        assert read == list(range(0, len(long_ids), chunk))[:len(read)] and len(read) == -(-len(long_ids) // chunk)
        assert second.out == want == first.out[:4]
    with pytest.raises(InputError, match="prefill_seconds"):
        Engine(smollm2).batch(2, prefill_chunk=16, prefill_seconds=0)


def test_a_prompt_being_read_can_be_cancelled_and_alone_is_read_whole(smollm2, prompts):
    batch = Engine(smollm2).batch(2, prefill_chunk=16)
    with torch.inference_mode():
        alone = batch.add(prompts[0], "ar", max_new_tokens=4)
        assert batch.prefilling is None and batch.rows == [alone]       # nothing decoding: read at once
        reading = batch.add(prompts[1], "ar", max_new_tokens=4)
        assert batch.prefilling.request is reading
        batch.cancel(reading)
        assert batch.prefilling is None and reading.done and batch.rows == [alone] and not batch.full
        while len(batch):
            batch.step()
    with pytest.raises(InputError, match="prefill_chunk"):
        Engine(smollm2).batch(2, prefill_chunk=0)


def test_a_policy_budget_above_the_engines_is_served(smollm2, self_drafter, prompts, ar_alone):
    """F1: a batch-size policy whose N exceeds the engine's overflowed every request's context
    buffer (sized by the engine's N): the whole batch failed. Each request is sized for the
    largest budget a step may verify."""
    engine = Engine(smollm2, self_drafter, GraftConfig(budget=8))
    got = decode_batch(engine.batch(2, policy={1: GraftConfig(budget=32)}), prompts[:2], "graft", 24)
    assert [tokens for tokens, _ in got] == ar_alone[:2]


def test_bad_batches_are_clear_errors(smollm2, self_drafter, prompts):
    engine = Engine(smollm2, self_drafter)
    with pytest.raises(InputError, match="max_batch must be an int >= 1"):
        engine.batch(0)
    with pytest.raises(InputError, match="policy keys must be batch sizes"):
        engine.batch(2, policy={0: GraftConfig()})
    with pytest.raises(InputError, match="hold"):
        engine.batch(2, hold=-1)
    with pytest.raises(InputError, match="max_len must be an int"):
        engine.batch(2, max_len=smollm2.config.max_position_embeddings + 1)
    batch = Engine(smollm2).batch(2)
    with pytest.raises(InputError, match="unknown method"):
        batch.add(prompts[0], "nope", 4)
    with pytest.raises(InputError, match="needs a drafter"):
        batch.add(prompts[0], "graft", 4)
    assert len(batch) == 0


def test_a_fixed_pool_is_made_once_and_refuses_longer_requests(smollm2, self_drafter, prompts, ar_alone):
    """With max_len the caches are one pool made with the batch: requests decode in it as before, a
    longer one is refused, and the pool's storage never changes."""
    batch = Engine(smollm2, self_drafter).batch(2, max_len=len(prompts[1]) + 24)
    kv = smollm2.net.kv
    with torch.inference_mode():
        with pytest.raises(InputError, match="max_len of"):
            batch.add(prompts[1], "graft", max_new_tokens=25)
        request = batch.add(prompts[1], "graft", max_new_tokens=24)
        while len(batch):
            batch.step()
    assert request.out == ar_alone[1]
    assert smollm2.net.kv.data_ptr() == kv.data_ptr() and smollm2.net.kv.shape == kv.shape


def test_the_budget_follows_the_batch_size(smollm2, self_drafter, prompts, ar_alone):
    """Policy {1: N = 12, 2: N = 4}: a step of two requests verifies 4 nodes each, a step of one 12
    (no copy verified wider: copy_budget = N)."""
    policy = {1: GraftConfig(budget=12), 2: GraftConfig(budget=4, tau=0.2)}
    batch = Engine(smollm2, self_drafter, GraftConfig(copy_budget=16)).batch(2, policy=policy)
    assert batch.plan(1).budget == 12 and batch.plan(2).budget == 4 and batch.plan(8).budget == 4
    a = batch.add(prompts[0], "graft", max_new_tokens=6)
    b = batch.add(prompts[1], "graft", max_new_tokens=24)
    while len(batch):
        batch.step()
    assert a.out == ar_alone[0][:6] and b.out == ar_alone[1]
    nodes = b.stats.per_step["nodes"]
    shared = len(a.stats.per_step["nodes"])        # the steps a and b were verified together
    assert set(nodes[:shared]) == {4} and set(nodes[shared:]) == {12}


def test_batched_drafting_grows_the_trees_a_request_grows_alone(smollm2, self_drafter, prompts):
    """One drafter forward per depth for the whole batch drafts what each request drafts alone:
    two requests batched commit, step by step, what each commits decoded alone (same trees, same
    accepted paths; "tree": no retrieval or estimates shared between them)."""
    alone = [graft_tk.decode(smollm2, ids, drafter=self_drafter, method="tree", max_new_tokens=24).stats["per_step"]
             for ids in prompts[:2]]
    got = decode_batch(Engine(smollm2, self_drafter).batch(2), prompts[:2], "tree", 24)
    for (_, stats), ref in zip(got, alone):
        assert stats["per_step"]["committed"] == ref["committed"]
        assert stats["per_step"]["drafter_forwards"] == ref["drafter_forwards"]


def test_speculation_off_at_a_batch_size_and_back_on(smollm2, self_drafter, prompts, ar_alone):
    """Policy {2: N = 1}: while two requests share the batch they decode plainly (no drafting, one
    token per step); alone again, the long one speculates, its drafter catching up on the tokens it
    missed. Both equal their `ar` decodes."""
    batch = Engine(smollm2, self_drafter).batch(2, policy={2: GraftConfig(budget=1)})
    a = batch.add(prompts[0], "graft-paper", max_new_tokens=6)
    b = batch.add(prompts[1], "graft-paper", max_new_tokens=24)
    while len(batch):
        batch.step()
    assert a.out == ar_alone[0][:6] and b.out == ar_alone[1]
    shared = len(a.stats.per_step["nodes"])
    assert set(b.stats.per_step["drafter_forwards"][:shared]) == {0} and set(b.stats.per_step["committed"][:shared]) == {1}
    assert all(f >= 1 for f in b.stats.per_step["drafter_forwards"][shared:])
    assert b.stats.per_step["nodes"][shared:] and set(b.stats.per_step["nodes"][shared:]) == {16}


def test_a_batch_that_never_speculates_skips_the_drafters_pass_and_ms_warm_up(smollm2, self_drafter, prompts,
                                                                                ar_alone, monkeypatch):
    """Every config at N = 1 (what graft-calibrate --cost-only writes where a verify row costs a
    forward): no prefill work for speculation. With D = 0 only the drafter's pass is skipped."""
    engine = Engine(smollm2, self_drafter, GraftConfig(budget=1))
    monkeypatch.setattr(engine.runtime.drafter, "start", lambda *a: pytest.fail("drafter prefilled"))
    batch = engine.batch(1)
    a = batch.add(prompts[0], "graft", max_new_tokens=12)
    assert (engine.state.source("adjacency").matrix == -1).all()        # M not warmed from the prompt
    while len(batch):
        batch.step()
    assert a.out == ar_alone[0][:12]
    warm = Engine(smollm2, self_drafter, GraftConfig(budget=4, max_depth=0)).batch(1)
    monkeypatch.setattr(warm.runtime.drafter, "start", lambda *a: pytest.fail("drafter prefilled"))
    b = warm.add(prompts[0], "graft", max_new_tokens=12)
    while len(warm):
        warm.step()
    assert b.out == ar_alone[0][:12]


def test_no_drafting_at_a_batch_size_then_drafting_again(smollm2, self_drafter, prompts, ar_alone):
    """Policy {2: N = 4, D = 0}: while two requests share the batch they speculate without the
    drafter (retrieval only: no drafter forward, 4-node trees); alone again, the long one's drafter
    reads its prompt between steps and it drafts from the step after the next (a step right after
    a read does not draft). Both equal their `ar` decodes."""
    batch = Engine(smollm2, self_drafter).batch(2, policy={2: GraftConfig(budget=4, max_depth=0)})
    a = batch.add(prompts[0], "graft-paper", max_new_tokens=6)
    b = batch.add(prompts[1], "graft-paper", max_new_tokens=24)
    while len(batch):
        batch.step()
    assert a.out == ar_alone[0][:6] and b.out == ar_alone[1]
    shared, steps = len(a.stats.per_step["nodes"]), b.stats.per_step
    assert set(steps["drafter_forwards"][:shared]) == {0} and set(steps["nodes"][:shared]) == {4}
    assert steps["drafter_forwards"][shared] == 0
    assert steps["nodes"][shared + 1:] and all(f >= 1 for f in steps["drafter_forwards"][shared + 1:])


def test_a_batch_slower_speculating_than_plain_decodes_plainly(smollm2, self_drafter, prompts, ar_alone, monkeypatch):
    """Where plain decoding measures faster than the batch's speculation, its steps verify the root
    alone (no sources, no drafter: a new row's drafter read waits too); speculation is still
    tried now and then. When speculation is back, the rows' drafters read their prompts between
    steps, one a step, never all inside one drafting step. Every answer equals `ar`'s."""
    cost = StepCost(verify_ms=tuple(10.0 + n for n in range(16)), draft_ms=(4.0,) * 4, step_ms=1.0)
    engine = Engine(smollm2, self_drafter, GraftConfig(cost=cost))
    check, policy = engine.state.controller([METHODS["graft"]] * 4).parts
    check.plain = [1000.0, 0.1]                                   # plain measured far faster
    check.speculating = [[1.0, 1.0] for _ in check.speculating]
    order: list[str] = []
    calls = record_drafter_reads(monkeypatch, engine.runtime.drafter, order)
    batch = engine.batch(4)
    rows = [batch.add(ids, "graft", max_new_tokens=24) for ids in prompts]
    for _ in range(12):
        batch.step()
    nodes = rows[0].stats.per_step["nodes"]
    assert nodes.count(1) >= len(nodes) - 1 and max(nodes) > 1          # a try of speculation among them
    assert check.best() == PlainCheck.PLAIN and calls == []              # no drafter read meanwhile
    check.plain = [0.1, 1.0]                                      # now speculation measures faster
    policy.drafted_accepted = 1e6                                 # and drafting pays
    while len(batch) == 4:
        batch.step()
    assert calls and not any(inside for _, inside, _ in calls)      # read between steps, one a step
    after_read = [order[i + 1] for i, e in enumerate(order[:-1]) if e == "read"]
    assert after_read and set(after_read) == {"step"}                 # the step after a read does not draft
    assert sum(f > 0 for f in rows[0].stats.per_step["drafter_forwards"]) > 0
    for r, ar in zip(rows, ar_alone):
        assert r.out == ar[:len(r.out)]


def test_the_plan_holds_the_largest_size_of_the_last_steps(smollm2, self_drafter, prompts, ar_alone):
    """hold = 3: after one of two requests leaves, the other keeps the two-request plan (here no
    speculation) for three more steps, then speculates at its own size."""
    batch = Engine(smollm2, self_drafter).batch(2, policy={2: GraftConfig(budget=1)}, hold=3)
    a = batch.add(prompts[0], "graft", max_new_tokens=6)
    b = batch.add(prompts[1], "graft", max_new_tokens=24)
    budgets = []
    while len(batch):
        batch.step()
        budgets.append(batch.last_step.budget)
    assert a.out == ar_alone[0][:6] and b.out == ar_alone[1]
    shared, committed = len(a.stats.per_step["nodes"]), b.stats.per_step["committed"]
    assert committed[:shared + 3] == [1] * (shared + 3)
    assert len(committed) > shared + 3 and set(b.stats.per_step["nodes"][shared + 3:]) == {16}
    assert budgets == [1] * (shared + 3) + [16] * (len(committed) - shared - 3)
