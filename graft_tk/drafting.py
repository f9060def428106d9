"""Drafting a token tree with a small drafter model, with calibrated dynamic-depth pruning.

The drafter keeps its own KV cache. Its first ``kv_len`` slots hold committed tokens; the
committed tokens it has not seen yet (``pending``, the root last) are run in the step's first
forward, which also gives the root's next-token distribution. Each further depth runs ONE
forward over the whole frontier (K nodes) with a tree mask, never one per node. Draft nodes use
scratch slots after the committed prefix; after acceptance ``commit`` moves the KV of accepted
draft nodes into place so the drafter never recomputes them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import GraftConfig
from .models import Model
from .reference.draft_expand import draft_expand
from .tree import DRAFT, ROOT, Tree


@dataclass
class Draft:
    tree: Tree          # root + at most N-1 drafted nodes, parents before children
    slots: Tensor       # int64 [N] drafter cache slot holding each node's KV, -1 if never run
    forwards: int       # drafter forward passes this step


def draft_tree(drafter: Model, kv_len: int, pending: list[int], cfg: GraftConfig, prune: bool) -> Draft:
    """Expand from the root (``pending[-1]``) up to ``cfg.max_depth`` and keep the best N-1 nodes.

    prune=True stops expanding once every frontier score is below log(tau) and drops nodes below
    it (methods ``pruned`` / ``graft``); prune=False drafts the full depth D (method ``tree``).
    """
    net, device, K, D = drafter.net, drafter.device, cfg.top_k, cfg.max_depth
    log_tau = math.log(cfg.tau) if prune else -math.inf
    P = len(pending)
    root_slot = kv_len + P - 1          # the root's KV lands here; scratch slots follow it
    logits = net(torch.tensor([pending], device=device), torch.arange(kv_len, kv_len + P, device=device),
                 kv_len, last_only=True)[0]                                   # [1, V]
    forwards = 1

    # Candidate pool in creation order, so parents precede children; parent -1 = the root.
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
        child_tok, child_par, child_score, nxt, stop = draft_expand(frontier_scores, logits, K, log_tau)
        m = child_tok.shape[0]
        tokens[n:n + m], scores[n:n + m], depths[n:n + m] = child_tok, child_score, depth
        if frontier is not None:
            parents[n:n + m] = frontier[child_par]
        frontier, frontier_scores = n + nxt, child_score[nxt]
        n += m
        # One host sync per depth: stopping decides whether another drafter forward is launched.
        if depth == D or (prune and bool(stop)):
            break
        # Run the new frontier (F <= K nodes) through the drafter in ONE forward with a tree mask.
        F = frontier.shape[0]
        new = torch.arange(n_scratch, n_scratch + F, device=device)
        slots[frontier] = root_slot + 1 + new
        p = parents[frontier]
        rows = anc[(slots[p.clamp(min=0)] - root_slot - 1).clamp(min=0)] & (p >= 0)[:, None]
        rows[torch.arange(F, device=device), new] = True
        anc[new] = rows
        mask = torch.cat([torch.ones(F, root_slot + 1, dtype=torch.bool, device=device),
                          anc[new, :n_scratch + F]], dim=1)                  # [F, start + F]
        positions = torch.full((F,), root_slot + depth, dtype=torch.long, device=device)
        logits = net(tokens[frontier][None], positions, root_slot + 1 + n_scratch, attn_mask=mask)[0]
        forwards += 1
        n_scratch += F

    keep = select_nodes(parents[:n], scores[:n], cfg.budget - 1, log_tau)
    return Draft(tree=_as_tree(tokens, parents, scores, depths, keep, pending[-1], device),
                 slots=torch.cat([torch.tensor([root_slot], device=device), slots[keep]]), forwards=forwards)


def select_nodes(parents: Tensor, scores: Tensor, n_keep: int, log_tau: float) -> Tensor:
    """Pool ids of the best ``n_keep`` nodes scoring >= log_tau, closed under parents, in pool order.

    A child never outscores its parent (log p <= 0), so the top scores already form a tree; the
    closure pass only matters for exact ties (p = 1 in fp32).
    """
    if n_keep <= 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    eligible = scores >= log_tau
    order = torch.argsort(torch.where(eligible, scores, -torch.inf), descending=True, stable=True)
    chosen = order[:n_keep][eligible[order[:n_keep]]]
    parent_of = parents.tolist()  # one transfer, then a host walk over <= N-1 nodes
    kept: set[int] = set()
    for i in chosen.sort().values.tolist():  # pool order = parents first
        if parent_of[i] < 0 or parent_of[i] in kept:
            kept.add(i)
    return torch.tensor(sorted(kept), dtype=torch.long, device=scores.device)


def _as_tree(tokens, parents, scores, depths, keep, root_token, device) -> Tree:
    remap = torch.full((tokens.shape[0],), -1, dtype=torch.long, device=device)
    remap[keep] = torch.arange(1, keep.shape[0] + 1, device=device)
    kept_parents = parents[keep]
    tree_parents = torch.where(kept_parents < 0, 0, remap[kept_parents.clamp(min=0)])
    n = keep.shape[0] + 1
    source = torch.full((n,), DRAFT, dtype=torch.int8, device=device)
    source[0] = ROOT
    return Tree(
        tokens=torch.cat([torch.tensor([root_token], device=device), tokens[keep]]),
        parents=torch.cat([torch.tensor([-1], device=device), tree_parents]).to(torch.int32),
        depth=torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths[keep]]).to(torch.int32),
        source=source,
        scores=torch.cat([torch.zeros(1, device=device), scores[keep]]).float(),
    )
