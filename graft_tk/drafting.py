"""Drafting a token tree with a small drafter model (EAGLE-2 style expansion, dynamic depth).

The drafter keeps its own KV cache. Its first ``kv_len`` slots hold committed tokens; the
committed tokens it has not seen yet (``pending``, the root last) are run in the step's first
forward, which also gives the root's next-token distribution. Each further depth runs ONE
forward over the whole frontier (K nodes) with a tree mask, never one per node. Draft nodes use
scratch slots after the committed prefix; after acceptance the engine moves the KV of accepted
draft nodes into place so the drafter never recomputes them.

``draft_pool`` returns every candidate it created (the *pool*); choosing which of them enter the
tree (tau, best N-1, grafting retrieval) is ``build_tree``'s job, in one op.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import GraftConfig
from .models import Model
from .ops import Ops


@dataclass
class DraftPool:
    """The drafter's candidates in creation order (parents before children); see ``build_tree``."""
    tokens: Tensor      # int64 [P]
    parents: Tensor     # int64 [P]  -1 = child of the root, else an earlier pool index
    scores: Tensor      # float32 [P] cumulative drafter log-prob
    depth: Tensor       # int64 [P]
    n: int              # valid entries (a host count: F*K per depth, known without a sync)
    slots: Tensor       # int64 [P] drafter cache slot holding each entry's KV, -1 if never run
    forwards: int       # drafter forward passes this step

    @classmethod
    def empty(cls, device) -> "DraftPool":
        """No drafter: retrieval-only methods graft onto the bare root."""
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z, torch.zeros(0, device=device), z, 0, z, 0)

    def slots_of(self, pool_index: Tensor) -> Tensor:
        """Drafter cache slot of each tree node (``build_tree``'s pool_index; -1: not drafted or never run)."""
        if self.slots.shape[0] == 0:
            return torch.full_like(pool_index, -1)
        return self.slots[pool_index.clamp(min=0)].masked_fill(pool_index < 0, -1)


def draft_pool(drafter: Model, kv_len: int, pending: list[int], cfg: GraftConfig, log_tau: float,
               ops: Ops) -> DraftPool:
    """Expand from the root (``pending[-1]``) up to ``cfg.max_depth`` depths.

    Expansion stops early once every new child scores below ``log_tau`` (scores only fall with
    depth, so nothing deeper could pass); ``log_tau = -inf`` drafts the full depth D (``tree``).
    """
    net, device, K, D = drafter.net, drafter.device, cfg.top_k, cfg.max_depth
    P = len(pending)
    root_slot = kv_len + P - 1          # the root's KV lands here; scratch slots follow it
    logits = net(torch.tensor([pending], device=device), torch.arange(kv_len, kv_len + P, device=device),
                 kv_len, last_only=True)[0]                                   # [1, V]
    forwards = 1

    pool_max = K + (D - 1) * K * K
    tokens = torch.zeros(pool_max, dtype=torch.long, device=device)
    parents = torch.full((pool_max,), -1, dtype=torch.long, device=device)
    scores = torch.full((pool_max,), -math.inf, device=device)
    depths = torch.zeros(pool_max, dtype=torch.long, device=device)
    slots = torch.full((pool_max,), -1, dtype=torch.long, device=device)
    # anc[s]: which scratch slots are ancestors-or-self of the node whose KV is in scratch slot s.
    n_scratch_max = K * (D - 1)
    anc = torch.zeros(n_scratch_max, n_scratch_max, dtype=torch.bool, device=device)
    frontier = None                       # pool ids of the nodes whose logits we hold; None = root
    frontier_scores = torch.zeros(1, device=device)
    n = n_scratch = 0
    for depth in range(1, D + 1):
        child_tok, child_par, child_score, nxt, stop = ops.draft_expand(frontier_scores, logits, K, log_tau)
        m = child_tok.shape[0]
        tokens[n:n + m], scores[n:n + m], depths[n:n + m] = child_tok, child_score, depth
        if frontier is not None:
            parents[n:n + m] = frontier[child_par]
        frontier, frontier_scores = n + nxt, child_score[nxt]
        n += m
        # One host sync per depth: stopping decides whether another drafter forward is launched.
        if depth == D or (log_tau > -math.inf and bool(stop)):
            break
        # Run the new frontier (F <= K nodes) through the drafter in ONE forward with a tree mask
        # over the scratch slots; every committed slot and the root are visible to all of them.
        F = frontier.shape[0]
        new = torch.arange(n_scratch, n_scratch + F, device=device)
        slots[frontier] = root_slot + 1 + new
        p = parents[frontier]
        rows = anc[(slots[p.clamp(min=0)] - root_slot - 1).clamp(min=0)] & (p >= 0)[:, None]
        rows[torch.arange(F, device=device), new] = True
        anc[new] = rows
        positions = torch.full((F,), root_slot + depth, dtype=torch.long, device=device)
        logits = net(tokens[frontier][None], positions, root_slot + 1 + n_scratch,
                     attn_mask=anc[new, :n_scratch + F], mask_prefix=root_slot + 1)[0]
        forwards += 1
        n_scratch += F
    return DraftPool(tokens, parents, scores, depths, n, slots, forwards)
