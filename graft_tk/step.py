"""The decode step, batch-first: every request in flight advances by one target forward.

``prefill`` starts a request in its batch row; ``decode_step`` is the one step every method and
every batch size runs (plain decoding is the step whose trees are the root alone). Top to bottom,
for the B rows at once:

  1-2. draft        the drafter's pool of every drafting row, one drafter forward per depth
                    (``graft_tk.drafting``)
  3-6. propose      every grafted source's candidates (``graft_tk.sources``), then ONE
                    ``build_tree``: prune, rerank, graft, the N - 1 likeliest nodes, mask bits
  7.   verify       one target forward over every row's tree (tree attention; each row over its
                    own prefix, a device tensor)
  8.   accept       the target's choice at every node (``graft_tk.sampling.choose``), then ONE
                    ``accept`` (path, bonus, the adjacency matrix's rows)
  9.   commit       on the device: new tokens into each row's context, the path's KV into place
                    (ONE ``commit_kv``); the sources count the outcome
       read         ONE device -> host read for the whole batch: each row's path and bonus
       settle       on the host: EOS and length limits, streaming, stats; the drafter keeps the
                    accepted drafted nodes' KV

Shapes are the batch's: B rows, N nodes per tree (the largest budget of the step's methods; a
row's unused places are padding, never accepted), so the device work of a step is the same
program whatever the trees hold. Host reads: one per step, plus one per drafter depth when a row
prunes, plus one when a request decoding alone asks the ``DraftGate`` whether to draft, plus
one when the cost model's policy chooses the verify's width (``graft_tk.policy``; the tree is then
built again at that width). ``StepCounters`` counts them, and the launches, per step.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .acceptance import SCORE_EDGES, node_probs, on_path_mask
from .config import GraftConfig, verifiable
from .counters import StepCounters, counting, host_read
from .drafting import DraftPool, DraftRequest
from .methods import Method
from .models.attention import AttentionPlan
from .sampling import Sampling, choose
from .sources import StepView
from .stats import DEPTH_BINS, RequestStats
from .tree import DRAFT, ROOT, SOURCE_NAMES, BuiltTree


@dataclass(eq=False)
class Request:
    """One request in decoding: its method, sampling and limits, and where it stands (host ints;
    its tokens live in its batch row's context on the device)."""
    method: Method
    sampling: Sampling
    max_new_tokens: int
    on_tokens: Callable[[list[int]], bool | None] | None
    prompt_tokens: int
    stats: RequestStats
    length: int = 0          # committed tokens, prompt first; the last one is the next tree's root
    target_len: int = 0      # committed tokens whose KV is in the target cache (all but the root)
    out: list[int] = field(default_factory=list)   # new tokens so far (what was streamed)
    done: bool = False

    def finish(self) -> dict:
        """The request's stats (``DecodeResult.stats``)."""
        return self.stats.finish(self.prompt_tokens, len(self.out))

    def take(self, new: list[int], eos: tuple[int, ...]) -> list[int]:
        """Commit ``new`` tokens: EOS and ``max_new_tokens`` cut them; stream them; returns what was kept."""
        for i, tok in enumerate(new):
            if tok in eos or len(self.out) + i + 1 >= self.max_new_tokens:
                new, self.done = new[:i + 1], True
                break
        self.out += new
        if self.on_tokens and self.on_tokens(new):
            self.done = True
        return new


@dataclass(frozen=True)
class StepRecord:
    """What one step did: rows in it, their tree budget (1 = no speculation), its seconds, the
    tokens it committed and its counters (graft-serve's /metrics sums them by size and budget)."""
    size: int
    budget: int
    seconds: float
    tokens: int
    counters: StepCounters


def prefill(engine, row: int, ids: list[int], request: Request, context: Tensor, speculates: bool = True,
            drafts: bool = True) -> None:
    """Start ``request`` in cache row ``row``: the target's prefill (its last position's logits
    give the first token; with the adjacency matrix warmed from every position's), the drafter's
    own pass, the prompt and the first token into ``context`` [L] (its row of the batch's).
    ``speculates`` / ``drafts`` False: no step of this batch ever will (every config's N = 1 /
    D = 0), so M's warm-up / the drafter's pass are skipped."""
    target, ops, method = engine.target, engine.ops, request.method
    tnet, device, n = target.net, target.device, len(ids)
    drafter = engine.drafter if method.drafts and speculates and drafts else None
    layers = drafter.target_layers if drafter is not None else None
    warm = speculates and method.uses("adjacency") and engine.adjacency.warm_from_prefill
    prompt = torch.tensor([ids], device=device)
    # Target features for an EAGLE-3 drafter, and the last layer's states when M is warmed (its
    # logits made a chunk at a time, never [n, V] at once).
    taken = (*(layers or ()), tnet.config.n_layers - 1) if warm else layers
    with tnet.cache_rows(row, row + 1):
        out = engine.target_step.prefill(prompt, hidden_layers=taken, attention=ops.tree_attention)
    logits, features = (out, None) if taken is None else (out[0], out[1][0])
    if warm:
        dim = tnet.config.dim
        engine.adjacency.warm(prompt[0], features[:, -dim:], tnet.logits)
        features = features[:, :-dim] if layers is not None else None
    if drafter is not None:
        drafter.start(row, prompt[0], features, ops)
    first = choose(logits, torch.tensor([[n]], device=device), [request.sampling])[0, 0]
    context[:n], context[n] = prompt[0], first
    request.length, request.target_len = n + 1, n
    request.stats.prefill_seconds = time.perf_counter() - request.stats.t0
    request.done = request.max_new_tokens <= 0
    if not request.done:
        request.take([host_read(first)[0]], target.eos_token_ids)


def decode_step(engine, rows: list[Request], context: Tensor, config: GraftConfig) -> StepRecord:
    """One step of every request in ``rows`` (cache rows 0 .. B - 1, ``context`` [B, L] their
    committed tokens) at ``config``'s N, tau and D; see the module docstring."""
    counters = StepCounters(count_torch_ops=engine.count_torch_ops)
    t0, committed_before = time.perf_counter(), sum(len(r.out) for r in rows)
    with counting(counters), engine.target.net.cache_rows(0, len(rows)):
        N = config.budget if any(r.method.speculates for r in rows) else 1
        built, pool, proposals, clock = _propose(engine, rows, context, config, N)
        outcome = _verify_and_commit(engine, rows, context, built, clock)
        _settle(engine, rows, built, pool, proposals, outcome, clock)
    record = StepRecord(len(rows), N, time.perf_counter() - t0, sum(len(r.out) for r in rows) - committed_before,
                        counters)
    if N > 1 and _gated(engine, rows):
        engine.draft_gate.observe(record.tokens, record.seconds, pool.forwards[0] > 0)
    for r in rows:
        r.stats.record_counters(counters)
    return record


class _Clock:
    """The step's phase times, added to every row's stats (each row waited for the whole batch)."""

    def __init__(self, rows: list[Request]):
        self.rows, self.t = rows, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        for r in self.rows:
            r.stats.seconds[phase] += now - self.t
        self.t = now


def _propose(engine, rows: list[Request], context: Tensor, config: GraftConfig, N: int):
    """Steps 1-6: every row's tree of N nodes."""
    B, device, ops = len(rows), engine.target.device, engine.ops
    clock = _Clock(rows)
    length = torch.tensor([r.length for r in rows], device=device)
    roots = context[:B].gather(1, (length - 1)[:, None])[:, 0]
    policy = engine.policy if B == 1 and rows[0].method.prune else None
    log_tau = [math.log(config.tau) if r.method.prune else -math.inf for r in rows]
    if policy is not None:   # the cost model's depth threshold (one request: the model is per request)
        log_tau = [policy.depth_log_tau(engine.draft_rates_host, SCORE_EDGES, log_tau[0])]
    drafts = [r.method.drafts and N > 1 for r in rows]
    view = StepView(roots, context[:B], length)
    early = {}     # proposals made before drafting (the gate reads them)
    if _gated(engine, rows) and drafts[0]:
        # draft less where prompt lookup already proposes: its chain's expected accepted tokens
        # against what the drafter is expected to add (graft_tk.policy.DraftGate; one host read)
        early["prompt_lookup"] = cand = engine.source("prompt_lookup").propose(view)
        p = cand.values.exp().masked_fill(cand.tokens < 0, 0.0)
        drafts[0] = engine.draft_gate.drafts(host_read(p.cumprod(1).sum(1))[0])
    pool = DraftPool.empty(B, device)
    depth = verifiable(config.max_depth, N)
    if any(drafts) and depth > 0 and (policy is None or policy.should_draft()):
        pool = engine.drafter.draft(DraftRequest(context[:B], [r.length for r in rows], drafts, log_tau,
                                                 verifiable(config.top_k, N), depth), ops)
    clock.lap("draft")
    if N == 1:                          # plain decoding: the root alone
        return _root_only(roots), pool, [], clock
    pool_values = None
    if pool.tokens.shape[1]:
        pool_values = engine.draft_rates.values(pool.scores)
        view = view._replace(pool_tokens=pool.tokens, pool_parents=pool.parents, pool_depth=pool.depth,
                             pool_n=pool.n, pool_values=pool_values)
    proposals = []
    for source in engine.sources:
        uses = torch.tensor([r.method.uses(source.name) for r in rows], device=device)[:, None]
        cand = early[source.name] if source.name in early else source.propose(view)
        proposals.append((source, cand._replace(tokens=torch.where(uses, cand.tokens, -1))))
    empty = torch.zeros(B, 0, device=device)
    cand_tokens = torch.cat([empty.long()] + [c.tokens for _, c in proposals], 1)
    cand_values = torch.cat([empty] + [c.values for _, c in proposals], 1)
    cand_source = torch.cat([empty.to(torch.int8)] + [
        c.source if c.source is not None else torch.full_like(c.tokens, s.code, dtype=torch.int8)
        for s, c in proposals], 1)

    def build(n: int) -> BuiltTree:
        return ops.build_tree(pool.tokens, pool.parents, pool.scores, pool.depth, pool.n, roots,
                              torch.tensor(log_tau, dtype=torch.float32, device=device), cand_tokens,
                              engine.cand_parents, cand_source, n, pool_values, cand_values)
    built = build(N)
    if policy is not None and engine.compile != "on":
        # the verify's width by expected gain per ms (one host read; a compiled forward keeps N:
        # every new width would compile a graph)
        n = policy.verify_width(host_read(built.values[0, 1:].sort(descending=True).values))
        if n < N:
            built = build(n)
    clock.lap("retrieve")
    return built, pool, proposals, clock


def _gated(engine, rows: list[Request]) -> bool:
    """A request decoding alone whose method prunes and has prompt lookup beside the drafter."""
    return len(rows) == 1 and rows[0].method.prune and rows[0].method.uses("prompt_lookup")


def _root_only(roots: Tensor) -> BuiltTree:
    """Every row's tree of one node: its root (plain decoding)."""
    B, device = roots.shape[0], roots.device
    z = torch.zeros(B, 1, dtype=torch.int32, device=device)
    return BuiltTree(tokens=roots[:, None], parents=z - 1, depth=z, source=z.to(torch.int8) + ROOT,
                     scores=torch.zeros(B, 1, device=device), pool_index=z.long() - 1, mask=(z + 1)[:, :, None],
                     n_nodes=torch.ones(B, dtype=torch.long, device=device),
                     cand_node=torch.zeros(B, 0, dtype=torch.int32, device=device),
                     values=torch.zeros(B, 1, device=device))


@dataclass
class _Outcome:
    """Steps 7-9 on the device: each row's accepted path, the verify's features."""
    path: Tensor                # int64 [B, N] accepted nodes, root first, -1 padded
    n_path: Tensor              # int64 [B]
    bonus: Tensor               # int64 [B]
    on_path: Tensor             # bool [B, N]
    features: Tensor | None     # [B, N, F] target features for an EAGLE-3 drafter


def _verify_and_commit(engine, rows: list[Request], context: Tensor, built: BuiltTree, clock: _Clock) -> _Outcome:
    """Steps 7-9's device part: one target forward over every row's tree, the choices, one accept
    (updating M), the new tokens into the context, the path's KV into place. No host read."""
    B, N = built.tokens.shape
    device, ops, tnet = engine.target.device, engine.ops, engine.target.net
    target_len = torch.tensor([r.target_len for r in rows], device=device)
    length = torch.tensor([r.length for r in rows], device=device)
    positions = target_len[:, None] + built.depth.long()
    plan = AttentionPlan.tree(target_len, built.attn_mask(), max(r.target_len for r in rows) + N)
    layers = engine.drafter.target_layers if engine.drafter is not None else None
    out = engine.target_step(built.tokens.clamp(min=0), positions, plan, hidden_layers=layers,   # padding runs as 0
                             attention=ops.tree_attention)
    logits, features = (out, None) if layers is None else out
    choice = choose(logits, positions + 1, [r.sampling for r in rows])
    writes = [r.method.uses("adjacency") for r in rows]
    path, n_path, bonus = ops.accept(built.tokens, built.parents, built.depth, built.mask, choice, logits,
                                     engine.adjacency.matrix if any(writes) else None,
                                     torch.tensor(writes, device=device))
    # Each row's accepted nodes after the root, then the bonus, into context[length:]; and the
    # path's KV from the tree's slots to the prefix's end. Fixed shapes: all N entries are
    # written; those past the path hold what the next step overwrites.
    i = torch.arange(N, device=device)
    nodes = path.clamp(min=0)
    new = torch.where(i == n_path[:, None] - 1, bonus[:, None], built.tokens.gather(1, nodes).roll(-1, 1))
    context[:B].scatter_(1, length[:, None] + i, new)
    ops.commit_kv(tnet.kv, target_len[:, None] + nodes, target_len)
    clock.lap("verify")
    return _Outcome(path, n_path, bonus, on_path_mask(path), features)


def _settle(engine, rows: list[Request], built: BuiltTree, pool: DraftPool, proposals: list, outcome: _Outcome,
            clock: _Clock) -> None:
    """The sources count the outcome; the step's ONE host read; then, on the host, every row's
    new tokens (cut at EOS and its limit), streaming, stats; the drafter's commit."""
    B, N = built.tokens.shape
    path, on_path = outcome.path, outcome.on_path
    if pool.tokens.shape[1]:
        engine.draft_rates.observe(built, on_path)
    at = 0
    for source, cand in proposals:
        C = cand.tokens.shape[1]
        source.observe(built, on_path, built.cand_node[:, at:at + C], cand.note)
        at += C
    S, D = len(SOURCE_NAMES), DEPTH_BINS
    by_source = torch.zeros(B, S + 1, dtype=torch.long, device=path.device).scatter_add_(
        1, built.source.long() + 1, torch.ones(B, N, dtype=torch.long, device=path.device))[:, 1:]
    # what the estimates expect to be accepted, per (source, depth) bin: checked against the outcome
    node_bin = (built.source.long() + 1) * D + built.depth.long().clamp(0, D - 1)
    expected = torch.zeros(B, (S + 1) * D, device=path.device).scatter_add_(1, node_bin, node_probs(built))[:, D:]
    p = path.clamp(min=0)
    node_slots = pool.slots_of(built.pool_index)
    wants_rates = engine.policy is not None and B == 1
    (n_path, bonus, tokens, slots, source, depth, nodes, exp, rates) = host_read(
        outcome.n_path, outcome.bonus, built.tokens.gather(1, p), node_slots.gather(1, p), built.source.gather(1, p),
        built.depth.gather(1, p), by_source, expected,
        engine.draft_rates.rate() if wants_rates else path[:0])
    if rates:
        engine.draft_rates_host = rates
    eos = engine.target.eos_token_ids
    path_slots = []
    for b, r in enumerate(rows):
        m, row = n_path[b], slice(b * N, b * N + n_path[b])
        new = r.take(tokens[row][1:] + [bonus[b]], eos)
        r.stats.record_step(source[row], depth[row], nodes[b * S:(b + 1) * S], len(new), pool.forwards[b], N)
        r.stats.record_expected(exp[b * S * D:(b + 1) * S * D], D)
        r.length += len(new)
        r.target_len += m
        path_slots.append(slots[row])
    if engine.acceptance_log is not None:
        engine.log_acceptance(built, on_path)
    if engine.policy is not None and B == 1:
        r = rows[0]
        engine.policy.observe(r.stats.per_step["committed"][-1], N, pool.widths, drafted=pool.forwards[0] > 0,
                              drafted_accepted=source[1:n_path[0]].count(DRAFT), drafted_verified=nodes[DRAFT])
    if engine.drafter is not None and any(r.method.drafts for r in rows):
        # 9. the drafter keeps the KV of accepted drafted nodes (an EAGLE-3 head: the path's features)
        engine.drafter.commit(path, n_path, path_slots, node_slots, outcome.features, engine.ops)
    clock.lap("commit")
