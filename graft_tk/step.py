"""The decode step, batch-first: every request in flight advances by one target forward.

``Prefill`` starts a request in its batch row (its prompt read whole or a chunk at a time);
``decode_step`` is the one step every method and every batch size runs (plain decoding is the
step whose trees are the root alone). It reads the models from a ``Runtime``, learns into a
``SpecState``, and asks a ``StepController`` what to do.
Top to bottom, for the B rows at once:

  0.   plan         the controller's ``StepPlan``: N, which rows draft, their thresholds, D and K
  1-2. draft        the drafter's pool of every drafting row, one drafter forward per depth
                    (``graft_tk.drafting``)
  3-6. propose      every grafted source's candidates (``graft_tk.sources``), then ONE
                    ``build_tree``: prune, rerank, graft, the N - 1 likeliest nodes, mask bits
                    -> ``Proposal``
  7.   verify       one target forward over every row's tree (tree attention; each row over its
                    own prefix, a device tensor), and a prompt's next chunk where one is being read
  8.   accept       the target's choice at every node (``graft_tk.sampling.choose``), then ONE
                    ``accept`` (path, bonus, the successor table's rows)
  9.   commit       on the device: new tokens into each row's context, the path's KV into place
                    (ONE ``commit_kv``) -> ``Outcome``
       observe      the sources and the drafter's rates count the outcome
       read         ONE device -> host read for the whole batch: each row's path and bonus
       settle       on the host: EOS and length limits, streaming, stats; the drafter keeps the
                    accepted drafted nodes' KV; the controller learns from the ``Observation``

Shapes are the batch's: B rows, N nodes per tree (a row's unused places are padding, never
accepted), so the device work of a step is the same program whatever the trees hold. Host reads:
one per step, plus one per drafter depth when a row prunes, plus what the controller reads to
decide (the draft gate or a batch's plain check: one; the cost policy's verify width: one, the
tree is then built again at that width). ``StepCounters`` counts them, and the launches, per step.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from .acceptance import node_probs, on_path_mask
from .compiled import EAGER_PREFILL_CHUNK
from .config import GraftConfig
from .counters import StepCounters, counting, host_read
from .drafting import DraftPool, DraftRequest, waiting_rows
from .models import exact
from .models.attention import AttentionPlan
from .models.transformer import Part
from .policy import Observation, RankedValues, StepController, StepPlan
from .request import Request
from .runtime import Runtime
from .sampling import choose
from .sources import Candidates, CandidateSource, StepView
from .state import SpecState
from .stats import DEPTH_BINS
from .tree import DRAFT, ROOT, SOURCE_NAMES, BuiltTree


@dataclass(frozen=True)
class StepRecord:
    """What one step did: rows in it, the nodes it verified per row (1 = no speculation; the cost
    policy may verify fewer than the config's budget), its seconds, the tokens it committed and
    its counters (graft-serve's /metrics sums them by size and width)."""
    size: int
    budget: int
    seconds: float
    tokens: int
    counters: StepCounters
    prompt_tokens: int = 0      # of a prompt being read, carried in its forward


class Prefill:
    """Start ``request`` in cache row ``row``: the target's prefill (its last position's logits
    give the first token; the sources that warm from the prompt read its states chunk by chunk),
    the drafter's start, the prompt and the first token into the row's context. ``read`` reads
    the next chunk of the prompt, or all of what is left, in forwards of its own; ``parts`` /
    ``took`` read a chunk inside a decode step's verify forward (the batch's other rows decode
    meanwhile); ``finish`` starts the request once all of it is read.
    ``speculates`` / ``drafts`` False: no step of this batch ever will (every config's N = 1 /
    D = 0), so the warm-ups / the drafter's start are skipped. ``row`` may change between
    chunks (the batch moves rows as requests leave)."""

    def __init__(self, runtime: Runtime, state: SpecState, row: int, request: Request,
                 speculates: bool = True, drafts: bool = True):
        self.runtime, self.row, self.request = runtime, row, request
        method, target = request.method, runtime.target
        self.drafter = runtime.drafter if method.drafts and speculates and drafts else None
        self.layers = self.drafter.target_layers if self.drafter is not None else None
        self.warmers = [s for s in state.sources if speculates and s.warms_from_prompt and method.uses(s.name)]
        self.prompt = torch.tensor([request.spec.ids], device=target.device)
        # Target features for an EAGLE-3 drafter, and the last layer's states for the sources that
        # warm from the prompt (read a chunk at a time as the prompt is, never [n, V] logits at once).
        self.taken = (*(self.layers or ()), target.net.config.n_layers - 1) if self.warmers else self.layers
        self.tokens_read, self.logits, self.hidden = 0, None, []

    @property
    def total(self) -> int:
        return self.prompt.shape[1]

    @property
    def read_all(self) -> bool:
        return self.tokens_read >= self.total

    def read(self, tokens: int | None = None) -> None:
        """Read the next ``tokens`` of the prompt (None: the rest) into the row's cache."""
        runtime, stop = self.runtime, self._stop(tokens)
        with runtime.kv.rows(self.row, self.row + 1):
            out = runtime.target_step.prefill(self.prompt, hidden_layers=self.taken, attention=runtime.target_attention,
                                              progress=self.request.on_prefill, start=self.tokens_read, stop=stop,
                                              grid=exact.PREFILL_GRID if runtime.exact else None)
        self._took(out, stop)

    def parts(self, tokens: int) -> list[Part]:
        """The next ``tokens`` of the prompt as parts of a packed forward (``Transformer.forward_packed``:
        the chunk rides in a decode step's verify), cut at multiples of exact mode's PREFILL_GRID
        (every reading of a prompt runs the same forwards), else of EAGER_PREFILL_CHUNK (its
        activations stay small); the forward's outputs for them go to ``took``."""
        grid = exact.PREFILL_GRID if self.runtime.exact else EAGER_PREFILL_CHUNK
        parts, device, s, stop = [], self.prompt.device, self.tokens_read, self._stop(tokens)
        while s < stop:
            t = min(grid - s % grid, stop - s)
            parts.append(Part(self.prompt[:, s:s + t], torch.arange(s, s + t, device=device)[None],
                              AttentionPlan.causal(s, 1, t, device), (self.row, self.row + 1), -1, self.taken))
            s += t
        return parts

    def took(self, parts: list[Part], outs: list) -> None:
        """The packed forward's outputs ``outs`` for ``parts`` (made by ``parts``): the chunk is read."""
        for part, out in zip(parts, outs):
            stop = self.tokens_read + part.tokens.shape[1]
            self._took(out, stop)
            if self.request.on_prefill is not None:
                self.request.on_prefill(stop, self.total)

    def _stop(self, tokens: int | None) -> int:
        return self.total if tokens is None else min(self.total, self.tokens_read + tokens)

    def _took(self, out, stop: int) -> None:
        """A forward's output over the prompt up to ``stop``: the last logits, the features taken;
        the sources that warm from the prompt read its last layer's states now, as it arrives."""
        self.logits, features = (out, None) if self.taken is None else out
        if self.warmers:
            net = self.runtime.target.net
            dim = net.config.dim
            for source in self.warmers:
                source.warm(self.prompt[0], features[0, :, -dim:], net.logits, start=self.tokens_read)
            features = features[..., :-dim] if self.layers is not None else None
        if features is not None:
            self.hidden.append(features[0])
        self.tokens_read = stop

    def finish(self, context: Tensor) -> None:
        """Start the request once its prompt is read: the drafter, the first token into ``context``
        [L] (its row of the batch's)."""
        request, target, prompt, n = self.request, self.runtime.target, self.prompt, self.total
        features = torch.cat(self.hidden) if self.hidden else None
        if self.drafter is not None:
            self.drafter.start(self.row, prompt[0], features, self.runtime.ops)
        first = choose(self.logits, torch.tensor([[n]], device=target.device), [request.sampling])[0, 0]
        context[:n], context[n] = prompt[0], first
        request.length, request.target_len = n + 1, n
        request.stats.prefill_seconds = time.perf_counter() - request.stats.t0
        request.done = request.spec.max_new_tokens <= 0
        if not request.done:
            request.take([host_read(first)[0]], target.eos_token_ids)


def decode_step(runtime: Runtime, state: SpecState, controller: StepController, rows: list[Request],
                context: Tensor, config: GraftConfig, may_draft: bool = True, chunk: Prefill | None = None,
                chunk_tokens: int = 0) -> StepRecord:
    """One step of every request in ``rows`` (cache rows 0 .. B - 1, ``context`` [B, L] their
    committed tokens) at ``config``'s N, tau and D as ``controller`` plans them (``may_draft``
    False: no row drafts); see the module docstring. ``chunk``: a prompt being read in row B,
    whose next ``chunk_tokens`` ride in the verify's forward (``Prefill.parts``)."""
    counters = StepCounters(count_torch_ops=runtime.count_torch_ops)
    t0, committed_before = time.perf_counter(), sum(len(r.out) for r in rows)
    with counting(counters), runtime.kv.rows(0, len(rows) + (chunk is not None)):
        clock = _Clock(rows)
        drafter = runtime.drafter
        unread = tuple(drafter is not None and drafter.unread(b) for b in range(len(rows)))
        parts = chunk.parts(chunk_tokens) if chunk is not None else []
        plan = StepPlan.fixed([r.method for r in rows], config, max(r.length for r in rows), unread,
                              riding=sum(p.tokens.shape[1] for p in parts))
        if drafter is not None:     # a new row's drafter reads between the batch's steps
            waiting = waiting_rows(drafter, plan.drafts)
            plan = dataclasses.replace(plan, drafts=tuple(d and not w and may_draft
                                                          for d, w in zip(plan.drafts, waiting)))
        proposal = _propose(runtime, state, controller, rows, context, plan, clock)
        outcome = _verify_and_commit(runtime, state, rows, context, proposal, clock, chunk, parts)
        seen = _settle(runtime, state, controller, rows, proposal, outcome, clock)
    record = StepRecord(len(rows), proposal.built.tokens.shape[1], time.perf_counter() - t0,
                        sum(len(r.out) for r in rows) - committed_before, counters, plan.riding)
    controller.observe(proposal.plan, dataclasses.replace(seen, committed=record.tokens,
                                                          seconds=record.seconds - proposal.pool.reading_seconds))
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


@dataclass
class Proposal:
    """Steps 0-6: what the step verifies."""
    plan: StepPlan
    built: BuiltTree                                       # every row's tree [B, N]
    pool: DraftPool                                        # the drafted candidates
    candidates: list[tuple[CandidateSource, Candidates]]   # every grafted source's, in graft order


def _propose(runtime: Runtime, state: SpecState, controller: StepController, rows: list[Request], context: Tensor,
             plan: StepPlan, clock: _Clock) -> Proposal:
    """Steps 0-6: every row's tree of N nodes."""
    B, device, ops = len(rows), runtime.device, runtime.ops
    length = torch.tensor([r.length for r in rows], device=device)
    roots = context[:B].gather(1, (length - 1)[:, None])[:, 0]
    view = StepView(roots, context[:B], length)

    def propose(source: CandidateSource, view: StepView) -> tuple[CandidateSource, Candidates]:
        cand = source.propose(view)     # rows whose method does not use it get none
        uses = torch.tensor([r.method.uses(source.name) for r in rows], device=device)[:, None]
        return source, cand._replace(tokens=torch.where(uses, cand.tokens, -1))
    # The sources that do not read the drafted pool propose first: their expected accepted
    # tokens are the controller's signal (the draft gate: whether the drafter is needed; a batch's
    # plain check: whether to speculate at all).
    early = [propose(s, view) for s in state.sources if not s.reads_pool] if plan.budget > 1 else []
    signals = [e for s, c in early if s.gates and (e := s.expected_accepted(c)) is not None]
    plan = controller.plan(plan, torch.stack(signals).sum(0) if signals else None)
    if plan.budget == 1:                # plain decoding: the root alone
        clock.lap("draft")
        return Proposal(plan, _root_only(roots), DraftPool.empty(B, device), [])
    pool = DraftPool.empty(B, device)
    if plan.drafting:
        pool = runtime.drafter.draft(DraftRequest(context[:B], [r.length for r in rows], list(plan.drafts),
                                                  list(plan.log_tau), plan.top_k, plan.depth), ops)
    clock.lap("draft")
    pool_values = None
    if pool.tokens.shape[1]:
        pool_values = state.draft_rates.values(pool.scores)
        view = view._replace(pool_tokens=pool.tokens, pool_parents=pool.parents, pool_depth=pool.depth,
                             pool_n=pool.n, pool_values=pool_values)
    late = {s.name: propose(s, view) for s in state.sources if s.reads_pool}
    early = {s.name: (s, c) for s, c in early}
    candidates = [early[s.name] if s.name in early else late[s.name] for s in state.sources]   # graft order
    empty = torch.zeros(B, 0, device=device)
    cand_tokens = torch.cat([empty.long()] + [c.tokens for _, c in candidates], 1)
    cand_values = torch.cat([empty] + [c.values for _, c in candidates], 1)
    cand_source = torch.cat([empty.to(torch.int8)] + [
        c.source if c.source is not None else torch.full_like(c.tokens, s.code, dtype=torch.int8)
        for s, c in candidates], 1)
    log_tau = torch.tensor(plan.log_tau, dtype=torch.float32, device=device)

    def build(n: int) -> BuiltTree:
        return ops.build_tree(pool.tokens, pool.parents, pool.scores, pool.depth, pool.n, roots, log_tau,
                              cand_tokens, state.cand_parents, cand_source, n, pool_values, cand_values)
    built = build(plan.budget)
    n = controller.width(plan, RankedValues(built.values))
    if n < plan.budget:
        built = build(n)
    clock.lap("retrieve")
    return Proposal(plan, built, pool, candidates)


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
class Outcome:
    """Steps 7-9 on the device: each row's accepted path, the verify's features."""
    path: Tensor                # int64 [B, N] accepted nodes, root first, -1 padded
    n_path: Tensor              # int64 [B]
    bonus: Tensor               # int64 [B]
    on_path: Tensor             # bool [B, N]
    features: Tensor | None     # [B, N, F] target features for an EAGLE-3 drafter


def _verify_and_commit(runtime: Runtime, state: SpecState, rows: list[Request], context: Tensor, proposal: Proposal,
                       clock: _Clock, chunk: Prefill | None = None, parts: list[Part] = ()) -> Outcome:
    """Steps 7-9's device part: one target forward over every row's tree (and ``parts``, the
    next chunk of ``chunk``'s prompt, in the same forward), the choices, one accept (updating
    the successor table), the new tokens into the context, the path's KV into place. No host
    read."""
    built = proposal.built
    B, N = built.tokens.shape
    device, ops = runtime.device, runtime.ops
    target_len = torch.tensor([r.target_len for r in rows], device=device)
    length = torch.tensor([r.length for r in rows], device=device)
    positions = target_len[:, None] + built.depth.long()
    plan = AttentionPlan.tree(target_len, built.attn_mask(), max(r.target_len for r in rows) + N)
    layers = runtime.drafter.target_layers if runtime.drafter is not None else None
    tokens = built.tokens.clamp(min=0)      # padding runs as 0
    if parts:
        outs = runtime.target_step.packed([Part(tokens, positions, plan, (0, B), None, layers), *parts],
                                          attention=runtime.target_attention)
        out = outs[0]
        chunk.took(parts, outs[1:])
    else:
        out = runtime.target_step(tokens, positions, plan, hidden_layers=layers, attention=runtime.target_attention)
    logits, features = (out, None) if layers is None else out
    choice = choose(logits, positions + 1, [r.sampling for r in rows])
    table = state.successors      # written for the rows whose method reads it
    writes = [table is not None and r.method.uses(table.name) for r in rows]
    path, n_path, bonus = ops.accept(built.tokens, built.parents, built.depth, built.mask, choice, logits,
                                     table.successors if any(writes) else None, torch.tensor(writes, device=device))
    # Each row's accepted nodes after the root, then the bonus, into context[length:]; and the
    # path's KV from the tree's slots to the prefix's end. Fixed shapes: all N entries are
    # written; those past the path hold what the next step overwrites.
    i = torch.arange(N, device=device)
    nodes = path.clamp(min=0)
    new = torch.where(i == n_path[:, None] - 1, bonus[:, None], built.tokens.gather(1, nodes).roll(-1, 1))
    context[:B].scatter_(1, length[:, None] + i, new)
    runtime.kv.commit(ops, target_len[:, None] + nodes, target_len)
    clock.lap("verify")
    return Outcome(path, n_path, bonus, on_path_mask(path), features)


def _settle(runtime: Runtime, state: SpecState, controller: StepController, rows: list[Request], proposal: Proposal,
            outcome: Outcome, clock: _Clock) -> Observation:
    """The estimates count the outcome; the step's ONE host read; then, on the host, every row's
    new tokens (cut at EOS and its limit), streaming, stats; the drafter's commit. Returns what
    the controller learns from (its committed tokens and seconds filled in by the caller)."""
    built, pool = proposal.built, proposal.pool
    B, N = built.tokens.shape
    path, on_path = outcome.path, outcome.on_path
    if pool.tokens.shape[1]:
        state.draft_rates.observe(built, on_path)
    at = 0
    for source, cand in proposal.candidates:
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
    (n_path, bonus, tokens, slots, source, depth, nodes, exp, rates) = host_read(
        outcome.n_path, outcome.bonus, built.tokens.gather(1, p), node_slots.gather(1, p), built.source.gather(1, p),
        built.depth.gather(1, p), by_source, expected,
        state.draft_rates.rate() if controller.wants_draft_rates else path[:0])
    eos = runtime.target.eos_token_ids
    path_slots, drafted_accepted = [], 0
    for b, r in enumerate(rows):
        m, row = n_path[b], slice(b * N, b * N + n_path[b])
        new = r.take(tokens[row][1:] + [bonus[b]], eos)
        r.stats.record_step(source[row], depth[row], nodes[b * S:(b + 1) * S], len(new), pool.forwards[b], N)
        r.stats.record_expected(exp[b * S * D:(b + 1) * S * D], D)
        r.length += len(new)
        r.target_len += m
        path_slots.append(slots[row])
        drafted_accepted += source[row][1:].count(DRAFT)
    if state.acceptance_log is not None:
        state.log_acceptance(built, on_path)
    if runtime.drafter is not None and any(r.method.drafts for r in rows):
        # 9. the drafter keeps the KV of accepted drafted nodes (an EAGLE-3 head: the path's features)
        runtime.drafter.commit(path, n_path, path_slots, node_slots, outcome.features, runtime.ops)
    clock.lap("commit")
    return Observation(committed=0, seconds=0.0, verified=N, draft_widths=pool.widths,
                       drafted=any(f > 0 for f in pool.forwards), drafted_accepted=drafted_accepted,
                       drafted_verified=sum(nodes[b * S + DRAFT] for b in range(B)),
                       draft_rates=rates or None, expected=sum(exp), accepted=sum(n_path) - B)
