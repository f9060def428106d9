"""Batched speculative decoding: several requests, one target forward per step.

A ``Batch`` holds up to ``max_batch`` requests, request i in batch row i of the target's KV cache
(and of a drafter model's). Each step runs the single-request step's parts (``Engine.propose``,
``Engine.settle``) per request and verifies every request's tree in ONE target forward:

    propose   per request, on its own cache row: draft (its drafter state), retrieve from the
              shared adjacency matrix M, prompt lookup in its context -> a tree of N nodes (padded)
    verify    tokens [B, N], positions [B, N] (its prefix length + depth), the trees' KV written
              to the last N slots of every row, each row's mask over its own prefix and its tree
    settle    per request: accept, update the shared M and estimates, stream, move the accepted
              path's KV from the tree slots to the end of its prefix

Requests join between steps (``add``: their prefill runs on their row alone) and leave when they
finish: the last row moves into the freed one, so the active requests always fill rows [0, B)
and the verify runs on exactly B rows (continuous batching). The adjacency matrix and the
acceptance estimates are the Engine's, shared by every request and kept when they leave.

Every request's greedy output is the one it gets decoded alone (its tree, its prefix and its mask
are its own; rows of a batched matmul do not mix); sampling stays lossless per request, each
with its own generator. The budget N, threshold tau and depth D follow the batch size (``policy``,
from ``graft-calibrate --batch B``; N = 1 is no speculation, D = 0 no drafting), held at the
largest size of the last ``hold`` steps where requests come and go. Not batched (yet): EAGLE-3
heads, compiled forwards, the per-step policy of a cost model (a batch verifies every tree at its
full budget N).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from contextlib import ExitStack, contextmanager
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from .backend import HOST_READS
from .config import METHODS, PRUNES, USES_DRAFTER, GraftConfig
from .drafting import DraftPool, Expansion, ModelDrafter, drafter_cache_slots
from .engine import DecodeState, Engine
from .errors import InputError
from .models.transformer import cache_visibility
from .sampling import next_token, sampling_generator
from .tree import ROOT


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one batched step did: requests in it, their tree budget (1 = no speculation), its
    seconds and the tokens it committed (graft-serve's /metrics sums them by size and budget)."""
    size: int
    budget: int
    seconds: float
    tokens: int


class Batch:
    """Up to ``max_batch`` requests of one method decoding together with ``engine``'s target,
    drafter, config, adjacency matrix and estimates."""

    def __init__(self, engine: Engine, method: str, max_batch: int, policy: Mapping[int, GraftConfig] | None = None,
                 hold: int = 0):
        if method not in METHODS:
            raise InputError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InputError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if engine.compile:
            raise InputError("a batch runs its forwards eagerly; build the Engine with compile=False")
        drafts = method in USES_DRAFTER
        if drafts and engine.drafting is None:
            raise InputError(f"method {method!r} needs a drafter: build the Engine with drafter=load_model(...)")
        if drafts and not isinstance(engine.drafting, ModelDrafter):
            raise InputError(f"batched {method!r} drafts with a drafter model (load_model); EAGLE-3 heads decode "
                             "one request at a time for now (max_batch=1)")
        self.engine, self.method, self.max_batch = engine, method, max_batch
        # The budget policy by batch size (graft-calibrate --batch B): batch size -> the config whose
        # N, tau and D a step of that many requests uses (the nearest calibrated size at or below it;
        # the engine's config below them all). A verify costs about B x N rows, so N falls as B
        # grows; N = 1 turns speculation off at that size (plain decoding, batched, no drafting),
        # D = 0 drafting (retrieval and prompt lookup only).
        self.policy = dict(sorted((policy or {}).items()))
        if any(not isinstance(b, int) or b < 1 for b in self.policy):
            raise InputError(f"policy keys must be batch sizes >= 1, got {sorted(self.policy)}")
        if not isinstance(hold, int) or hold < 0:
            raise InputError(f"hold must be an int >= 0 (steps), got {hold!r}")
        # The size a step plans for: the most requests of the last ``hold`` steps, at least the
        # requests in it. A server under steady load of B clients dips below B between one
        # request's end and the client's next; holding the plan keeps those steps from
        # speculating at the small sizes' budgets (0: plan by the step's own size).
        self.hold = hold
        self._recent: deque[int] = deque(maxlen=max(hold, 1))
        configs = [engine.config, *self.policy.values()]
        self.max_budget = 1 if method == "ar" else max(c.budget for c in configs)
        self.max_depth = max(c.max_depth for c in configs)
        self.seqs: list[DecodeState] = []    # request i decodes in cache row i
        self._cold: set[DecodeState] = set()   # requests whose drafter has not read their context yet
        # One drafter state per row, each over its row of the drafter model's cache.
        self._free_drafters = [ModelDrafter(engine.drafter) for _ in range(max_batch)] if drafts else []
        self._nets = [engine.target.net] + ([engine.drafter.net] if drafts else [])
        self.last_step: StepRecord | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def full(self) -> bool:
        return len(self.seqs) >= self.max_batch

    @torch.inference_mode()
    def add(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
            generator: torch.Generator | None = None, on_tokens: Callable | None = None) -> DecodeState:
        """Prefill a request into the next free row and return its state; it decodes from the next
        ``step`` on (or is done already: its first token ended it, and it takes no row)."""
        if self.full:
            raise InputError(f"the batch is full ({self.max_batch} requests); step until one finishes")
        cfg = self.engine.config
        # Slots a row needs: its tokens and a drafter's scratch; the trees' N slots after them.
        self._reserve(drafter_cache_slots(len(ids) + max_new_tokens, cfg.top_k, self.max_depth) + self.max_budget)
        row = len(self.seqs)
        drafter = self._free_drafters.pop() if self._free_drafters else None
        # Where the batch it joins does not speculate (N = 1), its prefill neither warms M nor starts
        # its drafter; where it does not draft (D = 0), the drafter waits: until the first step
        # that drafts (_start_drafters).
        plan = self.plan(self._load(row + 1))
        speculating = self.method != "ar" and plan.budget > 1
        drafting = speculating and plan.max_depth > 0
        try:
            with self._rows(row):
                seq = self.engine.begin(ids, self.method, max_new_tokens, temperature, top_p, generator, on_tokens,
                                        drafter=drafter, batched=True, speculating=speculating,
                                        drafting=drafting, max_budget=self.max_budget)
        except BaseException:
            if drafter is not None:
                self._free_drafters.append(drafter)
            raise
        if seq.done:
            self._release(seq)
        else:
            self.seqs.append(seq)
            if seq.drafter is not None and not drafting:
                self._cold.add(seq)
        return seq

    @torch.inference_mode()
    def step(self) -> list[DecodeState]:
        """One decode step for every request; returns those that finished (their rows freed)."""
        if not self.seqs:
            return []
        size = len(self.seqs)
        config = self.plan(self._load(size))
        self._recent.append(size)
        t, committed = time.perf_counter(), sum(len(seq.out) for seq in self.seqs)
        budget = 1 if self.method == "ar" else config.budget
        if budget == 1:
            self._plain_step()
        else:
            self._speculative_step(config)
        self.last_step = StepRecord(size, budget, time.perf_counter() - t,
                                    sum(len(seq.out) for seq in self.seqs) - committed)
        finished = [seq for seq in self.seqs if seq.done]
        for seq in finished:
            self._remove(seq)
        return finished

    def _plain_step(self) -> None:
        """N = 1 (``ar``, or speculation off at this batch size): every request's last committed
        token through one forward, its KV written at the request's own next slot, the next token
        drawn from the logits; no tree, no drafting, no adjacency update (a drafter catches up on
        the tokens it missed when speculation resumes)."""
        tnet, device, eos = self.engine.target.net, self.engine.target.device, self.engine.target.eos_token_ids
        B, S = len(self.seqs), tnet.cache_len
        t = time.perf_counter()
        at = torch.tensor([seq.target_len for seq in self.seqs], device=device)[:, None]      # [B, 1]
        roots = torch.stack([seq.root for seq in self.seqs])[:, None]
        with tnet.cache_rows(0, B):
            logits = tnet.forward_static(roots, at, at, (torch.arange(S, device=device) <= at)[:, None])[:, 0]
        new = torch.cat([next_token(logits[b:b + 1], seq.temperature, seq.top_p, seq.generator)
                         for b, seq in enumerate(self.seqs)])
        tokens = HOST_READS.read(new)                  # one host read for the whole batch
        seconds = time.perf_counter() - t
        for seq, tok, root in zip(self.seqs, tokens, new):
            seq.context[seq.length] = root
            seq.length, seq.target_len, seq.root = seq.length + 1, seq.target_len + 1, root
            seq.out.append(tok)
            seq.stats.seconds["verify"] += seconds
            seq.stats.host_reads += 1
            seq.stats.record_step([ROOT], [0], [], 1, 0, 1)
            seq.done = tok in eos or len(seq.out) >= seq.max_new_tokens
            if seq.on_tokens and seq.on_tokens([tok]):
                seq.done = True

    def _speculative_step(self, config: GraftConfig) -> None:
        """Steps 1-9 for every request: trees drafted and proposed per request, one verify."""
        engine, tnet = self.engine, self.engine.target.net
        for seq in self.seqs:
            seq.budget = config.budget
            seq.log_tau = math.log(config.tau) if self.method in PRUNES else -math.inf
        # 1-2. Every request's drafter tree, one drafter forward per depth for all of them.
        t, reads = time.perf_counter(), HOST_READS.count
        drafts = self.method in USES_DRAFTER and config.max_depth > 0
        if drafts:
            self._start_drafters()
        pools = self._draft(config.max_depth) if drafts else [DraftPool.empty(engine.target.device)] * len(self.seqs)
        for seq in self.seqs:   # every request waited for the whole batch's drafting
            seq.stats.seconds["draft"] += time.perf_counter() - t
            seq.stats.host_reads += HOST_READS.count - reads
        proposals = []
        for row, (seq, pool) in enumerate(zip(self.seqs, pools)):
            with self._rows(row):
                proposals.append(engine.propose(seq, pool))
        # 7. One target forward verifies every tree: tree slots [S - N, S) of each row, each row's
        # mask its prefix [0, target_len) and its tree's ancestors.
        t = time.perf_counter()
        B, N, S, device = len(self.seqs), self.seqs[0].budget, tnet.cache_len, engine.target.device
        tree_start = S - N
        prefix = torch.tensor([seq.target_len for seq in self.seqs], device=device)
        trees = [p.tree for p in proposals]
        visible = torch.cat([(torch.arange(tree_start, device=device) < prefix[:, None])[:, None].expand(B, N, -1),
                             torch.stack([tree.attn_mask() for tree in trees])], dim=-1)
        tokens = torch.stack([tree.tokens.clamp(min=0) for tree in trees])   # padding runs as token 0, masked
        positions = torch.stack([tree.positions(seq.target_len) for tree, seq in zip(trees, self.seqs)])
        with tnet.cache_rows(0, B):
            logits = tnet.forward_static(tokens, positions, torch.arange(tree_start, S, device=device), visible)
        verify_seconds = time.perf_counter() - t
        for row, (seq, proposal) in enumerate(zip(self.seqs, proposals)):
            seq.stats.seconds["verify"] += verify_seconds
            with self._rows(row):
                engine.settle(seq, proposal, engine.accept(seq, proposal, logits[row], None, tnet.kv, tree_start))

    def _start_drafters(self) -> None:
        """Prefill the drafter of each request that joined while the batch did not draft, on
        its row: every committed token but the root (which the step's first drafter forward runs)."""
        cfg, ops = self.engine.config, self.engine.ops
        for row, seq in enumerate(self.seqs):
            if seq in self._cold:
                slots = drafter_cache_slots(seq.prompt_tokens + seq.max_new_tokens, cfg.top_k, self.max_depth)
                with self._rows(row):
                    seq.drafter.start(seq.context[:seq.length - 1], slots, None, ops)
                self._cold.discard(seq)

    def _draft(self, max_depth: int) -> list[DraftPool]:
        """Steps 1-2 for every request with the drafter model's forwards batched: its committed
        tokens not yet in its cache row (the root last; rows left-padded to the longest), then each
        depth's frontier of every request still expanding (padded to the widest), one forward each.
        Padding writes its KV to the cache's last slot (never used otherwise) and sees slot 0 only.
        Each request's tree grows as ``graft_tk.drafting.expand`` grows it alone, to ``max_depth``."""
        engine, ops, seqs = self.engine, self.engine.ops, self.seqs
        cfg = dataclasses.replace(engine.config, max_depth=max_depth)
        net, device, B = engine.drafter.net, engine.target.device, len(seqs)
        S = net.cache_len

        def forward(rows: list[tuple[Tensor, Tensor, Tensor, Tensor]], last_only: bool) -> Tensor:
            """rows[b] = (tokens [T_b], positions, slots, visible [T_b, S]), right-aligned into [B, T]."""
            T = max(r[0].shape[0] for r in rows)
            tokens = torch.zeros(B, T, dtype=torch.long, device=device)
            positions = torch.zeros(B, T, dtype=torch.long, device=device)
            slots = torch.full((B, T), S - 1, dtype=torch.long, device=device)
            visible = torch.zeros(B, T, S, dtype=torch.bool, device=device)
            visible[:, :, 0] = True
            for b, (tok, pos, slot, vis) in enumerate(rows):
                n = tok.shape[0]
                tokens[b, T - n:], positions[b, T - n:], slots[b, T - n:], visible[b, T - n:] = tok, pos, slot, vis
            with net.cache_rows(0, B):
                return net.forward_static(tokens, positions, slots, visible, last_only=last_only)

        # The committed tokens each row has not run (the root last): its root's next-token logits.
        rows = []
        for seq in seqs:
            kv_len, P = seq.drafter.kv_len, seq.length - seq.drafter.kv_len
            span = torch.arange(kv_len, seq.length, device=device)
            block = torch.ones(P, P, dtype=torch.bool, device=device).tril()
            rows.append((seq.context[kv_len:seq.length], span, span, cache_visibility(S, kv_len, block)))
            seq.drafter.kv_len = seq.length
        logits = list(forward(rows, last_only=True))                          # B x [1, V]
        trees = [Expansion(device, cfg, seq.length - 1, r[0].shape[0]) for seq, r in zip(seqs, rows)]
        expanding = list(range(B))
        for depth in range(1, cfg.max_depth + 1):
            stops = [trees[b].grow(logits[b], seqs[b].log_tau, ops, None) for b in expanding]
            if depth == cfg.max_depth:
                break
            # One host read per depth for the whole batch: which requests expand further.
            pruned = [seqs[b].log_tau > -math.inf for b in expanding]
            flags = HOST_READS.read(torch.stack(stops).bool()) if any(pruned) else [False] * len(expanding)
            expanding = [b for b, p, f in zip(expanding, pruned, flags) if not (p and f)]
            if not expanding:
                break
            rows = [None] * B
            widths = {}
            for b in expanding:
                tokens, _, positions, start, block = trees[b].next_forward()
                F = widths[b] = tokens.shape[0]
                root_slot = trees[b].root_slot
                rows[b] = (tokens, positions, start + torch.arange(F, device=device),
                           cache_visibility(S, root_slot + 1, block))
            empty = torch.zeros(0, dtype=torch.long, device=device)
            rows = [r if r is not None else (empty, empty, empty, torch.zeros(0, S, dtype=torch.bool, device=device))
                    for r in rows]
            out = forward(rows, last_only=False)
            T = out.shape[1]
            logits = [out[b, T - widths[b]:] if b in widths else None for b in range(B)]
        return [tree.pool() for tree in trees]

    def _load(self, size: int) -> int:
        """The batch size to plan a step of ``size`` requests for (see ``hold``)."""
        return max([size, *self._recent]) if self.hold else size

    def plan(self, size: int) -> GraftConfig:
        """The config whose N, tau and D a step of ``size`` requests uses, from the policy."""
        config = self.engine.config
        for b, c in self.policy.items():
            if b <= size:
                config = c
        return config

    def cancel(self, seq: DecodeState) -> None:
        """Take a request out of the batch before it finishes (a client that went away)."""
        if seq in self.seqs:
            seq.done = True
            self._remove(seq)

    # --- rows
    @contextmanager
    def _rows(self, row: int):
        """The target's and a drafter model's forwards see only cache row ``row``."""
        with ExitStack() as stack:
            for net in self._nets:
                stack.enter_context(net.cache_rows(row, row + 1))
            yield

    def _reserve(self, slots: int) -> None:
        """Every cache with ``max_batch`` rows of at least ``slots`` slots; what rows hold is kept."""
        for net in self._nets:
            net.setup_cache(slots, batch_size=self.max_batch)

    def _remove(self, seq: DecodeState) -> None:
        """Free ``seq``'s row: the last row's request moves into it (its KV with it)."""
        row, last = self.seqs.index(seq), len(self.seqs) - 1
        if row != last:
            moved = self.seqs[last]
            for net in self._nets:
                net.kv[:, :, row] = net.kv[:, :, last]
            self.seqs[row] = moved
        self.seqs.pop()
        self._cold.discard(seq)
        self._release(seq)

    def _release(self, seq: DecodeState) -> None:
        if isinstance(seq.drafter, ModelDrafter):
            self._free_drafters.append(seq.drafter)


def decode_batch(engine: Engine, prompts: Sequence[list[int]], method: str, max_batch: int, max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 policy: Mapping[int, GraftConfig] | None = None) -> list[tuple[list[int], dict]]:
    """Decode token-id ``prompts`` with continuous batching, at most ``max_batch`` at a time (a
    prompt joins as soon as a row is free): [(new tokens, stats)] in the prompts' order."""
    batch = Batch(engine, method, max_batch, policy)
    results: dict[int, tuple[list[int], dict]] = {}
    index: dict[int, int] = {}                   # id(state) -> prompt index
    pending = list(enumerate(prompts))
    while pending or len(batch):
        while pending and not batch.full:
            i, ids = pending.pop(0)
            generator = sampling_generator(engine.target.device, temperature, None if seed is None else seed + i)
            seq = batch.add(list(ids), max_new_tokens, temperature, top_p, generator)
            if seq.done:
                results[i] = (seq.out, engine.finish(seq))
            else:
                index[id(seq)] = i
        for seq in batch.step():
            results[index.pop(id(seq))] = (seq.out, engine.finish(seq))
    return [results[i] for i in range(len(prompts))]
