"""Drafting every row's token tree at once: EAGLE-2 style expansion with dynamic depth (the ``draft`` source).

A ``Drafter`` keeps one cache row per batch row. Its ``draft`` grows every drafting row's tree
together, ONE drafter forward per depth for the whole batch (``expand``):

1. catch-up: each row's committed tokens its cache has not seen yet (the root last), left-aligned
   in one forward (padding writes to a trash slot); the root's logits start the tree.
2. depth d = 1 .. D: ``ops.draft_expand`` gives every frontier node its top-K children
   (cumulative log-prob scores) and the K best children of each row become its next frontier;
   the frontier runs through the drafter in one forward with a tree mask over scratch slots
   after the root (frontier node j of depth d at scratch slot (d - 1) K + j: a fixed layout).
   A row stops once every new child scores below its log tau (scores only fall with depth, so
   nothing deeper could pass): one host read per depth tells which rows go on, and only when some
   row prunes. Rows that stopped or do not draft ride along with their writes sent to the trash
   slot and their results dropped, so every forward has the batch's shape.

``draft`` returns every candidate created (the *pool*); choosing which enter the tree (tau, the
best N - 1, grafting) is ``build_tree``'s job. After acceptance ``commit`` keeps the KV of the
accepted drafted nodes (a small model) or the accepted path's target features (EAGLE-3).

``ModelDrafter`` (here) drafts with a small model with the target's tokenizer, its own KV cache;
``graft_tk.eagle3_drafter.Eagle3Drafter`` with an EAGLE-3 head over the target's own features.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

from .compiled import StepForward
from .counters import host_read
from .models import Model
from .models.attention import AttentionPlan
from .ops import Ops


@dataclass
class DraftPool:
    """Every row's drafted candidates in creation order (parents before children); see ``build_tree``."""
    tokens: Tensor      # int64 [B, P]
    parents: Tensor     # int64 [B, P]  -1 = child of the root, else an earlier pool index
    scores: Tensor      # float32 [B, P] cumulative drafter log-prob
    depth: Tensor       # int64 [B, P]
    slots: Tensor       # int64 [B, P] drafter cache slot holding each entry's KV, -1 if never run
    n: Tensor           # int64 [B]: valid entries of each row (K + (d - 1) K^2 after d depths)
    forwards: list[int]   # drafter forwards each row took part in this step (0: it did not draft)
    widths: tuple[int, ...]   # tokens per row in each drafter forward of the step (the cost model prices them)
    # seconds the step spent reading prompts (a row's first drafting step: ``ModelDrafter``); the
    # controllers learn what steps cost without it, it is paid once per request
    reading_seconds: float = 0.0

    @classmethod
    def empty(cls, batch: int, device) -> "DraftPool":
        """No drafting: the grafted sources fill the tree from the bare root."""
        z = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return cls(z, z, torch.zeros(batch, 0, device=device), z, z,
                   torch.zeros(batch, dtype=torch.long, device=device), [0] * batch, ())

    def slots_of(self, pool_index: Tensor) -> Tensor:
        """Drafter cache slot of each tree node [B, N] (``build_tree``'s pool_index; -1: not drafted or never run)."""
        if self.slots.shape[1] == 0:
            return torch.full_like(pool_index, -1)
        return self.slots.gather(1, pool_index.clamp(min=0)).masked_fill(pool_index < 0, -1)


@dataclass
class DraftRequest:
    """What ``draft`` needs of the step: ``context`` [B, L] and the host's ``length`` of every
    row, which rows draft, each row's log tau (host floats: -inf never prunes), K and D."""
    context: Tensor
    length: list[int]
    active: list[bool]
    log_tau: list[float]
    top_k: int
    max_depth: int


def drafter_cache_slots(tokens: int, top_k: int, max_depth: int) -> int:
    """Slots a drafter's cache row needs for a request of ``tokens`` (prompt + new tokens): each of
    them once committed, a step's scratch above them (``top_k`` per depth after the first) and the
    trash slot padding writes to."""
    return tokens + top_k * max_depth + 2


@runtime_checkable
class Drafter(Protocol):
    """What the step needs from a drafter (see the module docstring). Rows are batch rows."""
    net: nn.Module
    target_layers: tuple[int, ...] | None   # target features to request in prefill / verify (None: none)

    def reserve(self, rows: int, slots: int) -> None:
        """Cache rows for ``rows`` requests of ``slots`` slots each (what rows hold is kept)."""

    def start(self, row: int, prompt: Tensor, features: Tensor | None, ops: Ops) -> None:
        """A new request in ``row``: the target prefilled ``prompt`` [n] (``features`` [n, F] when
        asked for); the drafter runs its own pass over the prompt."""

    def draft(self, request: DraftRequest, ops: Ops) -> DraftPool:
        """Every active row's candidate pool under its root ``context[b, length[b] - 1]``."""

    def commit(self, path: Tensor, n_path: list[int], path_slots: list[list[int]], node_slots: Tensor,
               features: Tensor | None, ops: Ops) -> None:
        """After acceptance: ``path`` [B, N] accepted nodes (root first), ``n_path`` their count per
        row, ``path_slots`` their drafter cache slots as read by the host (-1: not drafted / never
        run), ``node_slots`` [B, N] every node's slot on the device, ``features`` [B, N, F] the
        verify forward's."""

    def move_row(self, src: int, dst: int) -> None:
        """Request ``src`` now lives in row ``dst`` (a batch keeps its rows packed)."""

    def unread(self, row: int) -> bool:
        """Whether ``row``'s next drafting step first reads the window of a long prompt (a drafter
        that read nothing at ``start``): that step costs a prompt read on top of its forwards."""

    def fresh(self, row: int) -> bool:
        """Whether ``row``'s drafter has read nothing of its request yet (its next drafting step, or
        ``read``, reads the prompt)."""

    def read(self, row: int, context: Tensor, length: int, ops: Ops) -> bool:
        """Read now what ``row``'s next drafting step would read first (its prompt, or its sink and
        window; ``context`` [L] the row's committed tokens, ``length`` of them): a batch does it
        between steps, so no step carries it. False: nothing to read."""


def waiting_rows(drafter: Drafter, drafts: Sequence[bool]) -> list[bool]:
    """Of a batch's rows (``drafts``: whose method drafts), those whose drafter has read nothing
    while another's has: they do not draft until they have read their prompt, which the batch
    does between steps, one row at a time (``Batch``), so no step of the running rows carries a
    prompt read. Rows that all start together read in their first drafting step, as alone."""
    fresh = [d and drafter.fresh(b) for b, d in enumerate(drafts)]
    started = any(d and not f for d, f in zip(drafts, fresh))
    return [f and started for f in fresh]


def expand(request: DraftRequest, root_logits: Tensor, catch_up: int, frontier_forward: Callable,
           root_slot: Tensor, context_slots: int, trash_slot: int, ops: Ops, vocab_map: Tensor | None = None
           ) -> DraftPool:
    """Grow every active row's tree from its root's logits ``root_logits`` [B, 1, V] (a catch-up
    forward of ``catch_up`` tokens per row) up to D depths; see the module docstring.

    ``frontier_forward(tokens [B, K], parent_rows [B, K], positions [B, K], plan)`` runs a depth's
    frontier (``parent_rows``: each node's parent's row in the previous forward) and returns its
    logits [B, K, V]. ``root_slot`` [B]: each row's root slot; its scratch slots follow;
    ``context_slots`` (host): the largest root slot + 1; rows that do not expand write to ``trash_slot``.
    ``vocab_map`` [V']: the logits are over a drafter vocabulary and entry i is the token of its id
    i (an EAGLE-3 head's ``draft_ids``): the K best of each row are ranked there and only they are mapped.
    """
    K, D = request.top_k, request.max_depth
    B, device = root_logits.shape[0], root_logits.device
    P = K + (D - 1) * K * K
    tokens = torch.zeros(B, P, dtype=torch.long, device=device)
    parents = torch.full((B, P), -1, dtype=torch.long, device=device)
    scores = torch.full((B, P), -math.inf, device=device)
    depth = torch.zeros(B, P, dtype=torch.long, device=device)
    slots = torch.full((B, P), -1, dtype=torch.long, device=device)
    log_tau = torch.tensor(request.log_tau, dtype=torch.float32, device=device)
    prunes = [a and t > -math.inf for a, t in zip(request.active, request.log_tau)]
    depths = [1 if a else 0 for a in request.active]   # depths each row has grown
    alive = list(request.active)
    widths = [catch_up]
    L = K * max(D - 1, 1)                                 # scratch slots: K per depth after the first
    anc = torch.zeros(B, L, L, dtype=torch.bool, device=device)   # ancestry of the node in each scratch slot

    def grow(at: int, frontier_scores: Tensor, logits: Tensor, frontier: Tensor | None, d: int, rows: Tensor):
        child_tok, child_par, child_score, nxt, stop = ops.draft_expand(frontier_scores, logits, K, log_tau)
        if vocab_map is not None:
            child_tok = vocab_map[child_tok]
        m = child_tok.shape[1]
        keep = rows[:, None]
        tokens[:, at:at + m] = torch.where(keep, child_tok, tokens[:, at:at + m])
        scores[:, at:at + m] = torch.where(keep, child_score, scores[:, at:at + m])
        depth[:, at:at + m] = torch.where(keep, d, depth[:, at:at + m])
        if frontier is not None:
            parents[:, at:at + m] = torch.where(keep, frontier[:, child_par], parents[:, at:at + m])
        return at + nxt, child_score.gather(1, nxt), child_par[nxt], stop

    rows = torch.tensor(alive, device=device)
    frontier, frontier_scores, child_par, stop = grow(0, torch.zeros(B, 1, device=device), root_logits, None, 1, rows)
    written, scratch0 = K, root_slot + 1
    for d in range(2, D + 1):
        # One host read per depth for the whole batch: which rows expand further (only when one prunes).
        if any(p and a for p, a in zip(prunes, alive)):
            stopped = host_read(stop)
            alive = [a and not (p and s) for a, p, s in zip(alive, prunes, stopped)]
        if not any(alive):
            break
        rows = torch.tensor(alive, device=device)
        j = (d - 2) * K + torch.arange(K, device=device)                     # this depth's scratch indices
        slots.scatter_(1, frontier, torch.where(rows[:, None], scratch0[:, None] + j, slots.gather(1, frontier)))
        p = parents.gather(1, frontier)                                      # the frontier's parents
        p_scratch = (slots.gather(1, p.clamp(min=0)) - scratch0[:, None]).clamp(0, L - 1)
        block = anc.gather(1, p_scratch[:, :, None].expand(-1, -1, L)) & (p >= 0)[:, :, None]
        block[:, torch.arange(K, device=device), j] = True
        anc.index_copy_(1, j, block)
        plan = AttentionPlan.explicit(torch.where(rows[:, None], scratch0[:, None] + j, trash_slot), scratch0, block,
                                      context_slots + L)
        positions = (root_slot + d - 1)[:, None].expand(-1, K)
        logits = frontier_forward(tokens.gather(1, frontier), child_par, positions, plan)
        frontier, frontier_scores, child_par, stop = grow(written, frontier_scores, logits, frontier, d, rows)
        written += K * K
        widths.append(K)
        depths = [n + 1 if a else n for n, a in zip(depths, alive)]
    n = torch.tensor([K + (x - 1) * K * K if x else 0 for x in depths], device=device)
    return DraftPool(tokens, parents, scores, depth, slots, n, depths, tuple(widths))


@dataclass
class CatchUp:
    """One forward over each row's entries its cache has not seen, left-aligned in [B, T]."""
    at: Tensor       # int64 [B, T]: each entry's cache slot (padding: past the row's entries)
    real: Tensor     # bool [B, T]: a real entry, not padding
    plan: AttentionPlan   # writes to ``at`` (padding to the trash slot), causal over each row's cache
    last: Tensor     # int64 [B]: each row's last real entry (its logits start the tree)


class CachedDrafter:
    """What the drafters share: a cache row per batch row, how many committed entries each holds
    (``kv_len``), the trash slot padding writes to, moving a row, and the catch-up forward."""

    def __init__(self, net: nn.Module):
        self.net = net
        self.kv_len: list[int] = []

    def reserve(self, rows: int, slots: int) -> None:
        self.net.setup_cache(slots, batch_size=rows)
        self.kv_len += [0] * (rows - len(self.kv_len))

    @property
    def trash_slot(self) -> int:
        return self.net.cache_len - 1

    def move_row(self, src: int, dst: int) -> None:
        self.net.kv[:, :, dst] = self.net.kv[:, :, src]
        self.kv_len[dst] = self.kv_len[src]

    def unread(self, row: int) -> bool:
        return False        # read at ``start``

    def fresh(self, row: int) -> bool:
        return False

    def read(self, row: int, context: Tensor, length: int, ops: Ops) -> bool:
        return False

    def catch_up(self, counts: list[int], device) -> CatchUp:
        """The layout of one forward over ``counts[b]`` new entries of each row b, after its ``kv_len``."""
        kv_len, T = self.kv_len[:len(counts)], max(counts)
        start = torch.tensor(kv_len, device=device)
        n = torch.tensor(counts, device=device)
        at = start[:, None] + torch.arange(T, device=device)
        real = at < (start + n)[:, None]
        plan = AttentionPlan(torch.where(real, at, self.trash_slot), start, None, max(kv_len) + T)
        return CatchUp(at, real, plan, (n - 1).clamp(min=0))


class ModelDrafter(CachedDrafter):
    """A small drafter model with the target's tokenizer (its own KV cache, kept across steps).

    With a ``window`` it reads only the first ``sink`` tokens and the last ``window`` of a prompt:
    its cache holds the sink, the window and everything committed after the prompt, at
    consecutive positions (what lies between is skipped, as StreamingLLM keeps an attention sink
    and a recent window). A long prompt is the target's to read; the drafter's proposals are
    verified, so what it does not read costs acceptance, never output. A row whose drafter fell
    more than a window behind (steps that did not draft: a long copy) reads its sink and its last
    window again rather than every token it missed."""
    target_layers = None

    def __init__(self, model: Model, compile: bool = False, window: int | None = None, sink: int = 4):
        super().__init__(model.net)
        self.model, self.window, self.sink = model, window, sink
        self.step = StepForward(model.net, compile, dynamic=True)   # its forwards change width
        self.skipped: list[int] = []   # per row: the prompt tokens between the sink and the window
        self._drafted = False    # this step drafted: its commit moves the accepted nodes' KV

    def reserve(self, rows: int, slots: int) -> None:
        super().reserve(rows, slots)
        self.skipped += [0] * (rows - len(self.skipped))

    def move_row(self, src: int, dst: int) -> None:
        super().move_row(src, dst)
        self.skipped[dst] = self.skipped[src]

    def unread(self, row: int) -> bool:
        return self.fresh(row) and self.skipped[row] > 0     # a prompt longer than sink + window

    def fresh(self, row: int) -> bool:
        return self.kv_len[row] == 0

    def start(self, row: int, prompt: Tensor, features: Tensor | None, ops: Ops) -> None:
        """Nothing runs here: the row's first drafting step reads the sink and the window
        (``_read_prompts``), so the first token does not wait for the drafter, and a request
        whose steps never draft never pays for it."""
        n = prompt.shape[0]
        self.skipped[row] = max(n - self.sink - self.window, 0) if self.window is not None else 0
        self.kv_len[row] = 0

    def read(self, row: int, context: Tensor, length: int, ops: Ops) -> bool:
        """A row whose cache is empty reads its committed tokens up to the root (its sink and
        window of them), alone (a prefill: torch's fused causal attention, no batch padding)."""
        end = length - self.skipped[row]      # the root's slot + 1
        if self.kv_len[row] or end <= 1:
            return False
        kept = context[self._context_index(torch.arange(end - 1, device=context.device), self.skipped[row])]
        with self.net.cache_rows(row, row + 1):
            self.step.prefill(kept[None], attention=ops.tree_attention)     # as the target's prefill
        self.kv_len[row] = end - 1
        return True

    def _read_prompts(self, request: DraftRequest, ops: Ops) -> float:
        """Each drafting row whose cache is empty reads now (``read``); returns the seconds spent."""
        t0 = time.perf_counter()
        for b, (active, n) in enumerate(zip(request.active, request.length)):
            if active and self.fresh(b):
                self.read(b, request.context[b], n, ops)
        return time.perf_counter() - t0

    def _rewindow(self, request: DraftRequest) -> None:
        """Each drafting row more than a window behind starts again (its next read: the sink and
        the window before its root), as a new prompt does."""
        if self.window is None:
            return
        for b, (active, n) in enumerate(zip(request.active, request.length)):
            if active and self.kv_len[b] and n - self.skipped[b] - self.kv_len[b] > self.window:
                self.skipped[b], self.kv_len[b] = max(n - 1 - self.sink - self.window, 0), 0

    def _context_index(self, slots: Tensor, skipped: Tensor | int) -> Tensor:
        """Where in the committed context the token of each cache slot is: a slot past the sink
        holds the token ``skipped`` places further (the prompt tokens between sink and window)."""
        return torch.where(slots < self.sink, slots, slots + skipped)

    def draft(self, request: DraftRequest, ops: Ops) -> DraftPool:
        B, device, context = len(request.length), request.context.device, request.context
        self._rewindow(request)
        ends = [n - s for n, s in zip(request.length, self.skipped)]     # each row's root slot + 1
        reading = self._read_prompts(request, ops)
        # catch-up: the committed tokens each drafting row's cache has not seen, the root last
        pending = [e - k if a else 0 for e, k, a in zip(ends, self.kv_len, request.active)]
        up = self.catch_up(pending, device)
        skipped = torch.tensor(self.skipped[:B], device=device)[:, None]
        index = self._context_index(up.at, skipped).clamp(max=context.shape[1] - 1)
        self._drafted = True
        with self.net.cache_rows(0, B):
            root_logits = self.step(context[:B].gather(1, index).masked_fill(~up.real, 0),
                                    up.at.clamp(max=self.trash_slot), up.plan, logits_at=up.last,
                                    attention=ops.tree_attention)
            for b, a in enumerate(request.active):
                if a:
                    self.kv_len[b] = ends[b]

            def frontier(tokens, parent_rows, positions, plan):
                return self.step(tokens, positions, plan, attention=ops.tree_attention)

            pool = expand(request, root_logits, max(pending), frontier, torch.tensor(ends, device=device) - 1,
                          max(ends), self.trash_slot, ops)
        pool.reading_seconds = reading
        return pool

    def commit(self, path: Tensor, n_path: list[int], path_slots: list[list[int]], node_slots: Tensor,
               features: Tensor | None, ops: Ops) -> None:
        # Keep the KV of each row's longest drafted-and-run path prefix (the rest stays pending and
        # runs in the next step's catch-up). One move for the batch whenever it drafted, rows with
        # nothing to keep padded with moves of a slot onto itself (the step's launches never
        # depend on what was accepted).
        keep = []
        for slots in path_slots:
            ran = [s >= 0 for s in slots[1:]] + [False]
            keep.append(ran.index(False))
        drafted, self._drafted = self._drafted, False
        if not drafted:
            return
        B, width = len(keep), max(max(keep), 1)
        device = path.device
        dst = torch.tensor(self.kv_len[:B], device=device)
        i = torch.arange(width, device=device)
        src = node_slots.gather(1, path[:, 1:1 + width].clamp(min=0))
        src = torch.where(i < torch.tensor(keep, device=device)[:, None], src, dst[:, None] + i)   # padding: no move
        with self.net.cache_rows(0, B):
            ops.commit_kv(self.net.kv, src, dst)
        for b, k in enumerate(keep):
            self.kv_len[b] += k
