"""Graft: merge the candidates of every source into the drafted tree, up to the verification budget N.

Every candidate node (drafted, retrieved from the adjacency matrix, from prompt lookup) carries
an estimate of log P(its whole path is accepted) (``graft_tk.acceptance``); the N - 1 places go
to the highest estimates, parents before children (``allocate``). Without estimates every node
ties and the budget fills in index order: the drafted nodes, then the candidates in template
(BFS) order. Worked example of that case (budget_n = 5)::

    draft            tokens [r, a, b]  parents [-1, 0, 0]           (2 drafted nodes)
    template         parents [-1, -1, 0, 1]   retrieved [a, c, x, y]
    merge, BFS order: a  -> (root, a) exists: reuse node 1, no budget spent
                      c  -> new node 3 under the root
                      x  -> template parent mapped to node 1: new node 4 under a (chain grafted
                            beneath a drafted node)
                      y  -> budget full (5 nodes): dropped
    result           tokens [r, a, b, c, x]  parents [-1, 0, 0, 0, 1]

``build_tree`` is the whole step-2..6 pipeline as ONE op over a batch of rows (the Triton kernel
in ``graft_tk.kernels.build_tree`` has the same signature): prune + rerank each row's drafter
pool, build the drafted tree, graft every candidate source, and emit fixed-shape tree tensors
plus the bit-packed ancestor mask, so the device never waits for the host.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..tree import DRAFT, ROOT, BuiltTree, Tree, pack_mask


def allocate(draft: Tree, cand_tokens: Tensor, cand_parents: Tensor, cand_source: Tensor, budget_n: int,
             draft_values: Tensor | None = None, cand_values: Tensor | None = None
             ) -> tuple[Tree, list[int], list[int], list[float]]:
    """The budget allocator: (tree of at most ``budget_n`` nodes, tree node of each candidate or -1,
    the drafted nodes kept as indices into ``draft``, each tree node's value).

    1. Union: the drafted nodes (indices 1 .. draft.n - 1), then every candidate in index order.
       A candidate is missing when its token is -1 or its parent is missing; when (parent node,
       token) already exists it maps onto that node (so a retrieved chain continues beneath a
       drafted node at no cost); otherwise it becomes a new union node.
    2. Values (log P(on the accepted path)): the root has log 1 = 0; a drafted node's value is
       min(its own estimate, its parent's value) (a path is never likelier than its prefix); a
       candidate's is its tree parent's value + its own estimate (clamped to <= 0) + log of the
       probability its drafted siblings leave free (``free_share``), so a chain grafted beneath a
       drafted node is valued through that node and a token beside a sure drafted one is not
       valued as if it stood alone; a candidate that maps onto an existing node raises that
       node's value to its own if higher.
    3. Selection: the N - 1 best non-root union nodes by (value desc, union index asc). A child's
       value never exceeds its parent's and its index is larger, so the chosen set is closed under
       parents; nodes keep their union order (parents before children).
    """
    if not isinstance(budget_n, int) or budget_n < 1:
        raise ValueError(f"budget_n must be an int >= 1, got {budget_n!r}")
    if draft.n > budget_n:
        raise ValueError(f"the drafted tree has {draft.n} nodes, more than budget_n = {budget_n}")
    C = cand_tokens.shape[0]
    if cand_tokens.dim() != 1 or cand_parents.shape != (C,) or cand_source.shape != (C,):
        raise ValueError(f"cand_tokens, cand_parents, cand_source must be 1-D of one length, got "
                         f"{list(cand_tokens.shape)}, {list(cand_parents.shape)}, {list(cand_source.shape)}")
    if cand_values is not None and cand_values.shape != (C,):
        raise ValueError(f"cand_values must be [C={C}], got {list(cand_values.shape)}")
    if draft_values is not None and draft_values.shape != (draft.n,):
        raise ValueError(f"draft_values must be [n={draft.n}] (root first), got {list(draft_values.shape)}")
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    depth, source = draft.depth.tolist(), draft.source.tolist()
    value = _f32_list(draft_values, draft.n)
    value[0] = 0.0
    for i in range(1, draft.n):
        value[i] = min(value[i], value[parents[i]])
    cvalue = _f32_list(cand_values, C)
    valued = draft_values is not None or cand_values is not None
    node_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i > 0}
    mapped: list[int] = []  # candidate -> union node, -1 = missing
    for c, (tok, tpar, src) in enumerate(zip(cand_tokens.tolist(), cand_parents.tolist(), cand_source.tolist())):
        if not -1 <= tpar < c:
            raise ValueError(f"candidate {c} has parent {tpar}; need -1 (root) or an earlier candidate")
        parent = 0 if tpar < 0 else mapped[tpar]
        if tok < 0 or parent < 0:
            mapped.append(-1)
            continue
        node = node_of.get((parent, tok), -1)
        v = value[parent] + min(cvalue[c], 0.0)
        if valued:
            drafted_siblings = [value[d] for d in range(1, draft.n) if parents[d] == parent and d != node]
            v += free_share(value[parent], drafted_siblings)
        if node < 0:
            node = len(tokens)
            node_of[(parent, tok)] = node
            tokens.append(tok)
            parents.append(parent)
            depth.append(depth[parent] + 1)
            source.append(src)
            value.append(v)
        else:
            value[node] = max(value[node], v)
        mapped.append(node)

    # 3. the N - 1 best by (value desc, index asc); a stable sort on -value keeps index order in ties
    ranked = sorted(range(1, len(tokens)), key=lambda i: -value[i])
    keep = sorted([0] + ranked[:budget_n - 1])
    new_index = {old: new for new, old in enumerate(keep)}
    dev = draft.tokens.device
    drafted = [i for i in keep if i < draft.n]
    tree = Tree(
        tokens=torch.tensor([tokens[i] for i in keep], dtype=torch.int64, device=dev),
        parents=torch.tensor([new_index[parents[i]] if i else -1 for i in keep], dtype=torch.int32, device=dev),
        depth=torch.tensor([depth[i] for i in keep], dtype=torch.int32, device=dev),
        source=torch.tensor([source[i] for i in keep], dtype=torch.int8, device=dev),
        scores=torch.cat([draft.scores[drafted],
                          torch.full((len(keep) - len(drafted),), float("-inf"), dtype=torch.float32, device=dev)]),
    )
    return tree, [new_index.get(m, -1) for m in mapped], drafted[1:], [value[i] for i in keep]


FREE_FLOOR = 1e-3   # the least share of its parent a grafted candidate keeps beside its drafted siblings


def free_share(parent_value: float, sibling_values: list[float]) -> float:
    """log of the probability, given the parent accepted, that none of these drafted siblings is.

    Children of one node are exclusive (the target emits one token there), so a grafted candidate
    is accepted at most when every drafted sibling is rejected: P(c | parent) = P(no drafted
    sibling | parent) x P(c | parent, no drafted sibling), the second factor being what the
    source's rates learn (``acceptance.outcome`` counts a candidate only where no drafted sibling
    was accepted). A sibling's conditional is exp(its value - the parent's); the share is floored
    at ``FREE_FLOOR`` where over-confident estimates sum past 1.
    """
    taken = sum(math.exp(v - parent_value) for v in sibling_values if v > -math.inf)
    return math.log(max(1.0 - taken, FREE_FLOOR))


def _f32_list(values: Tensor | None, n: int) -> list[float]:
    """Host copy of float32 values (0.0 each when None), rounded to float32 as the kernel sees them."""
    if values is None:
        return [0.0] * n
    return values.to(torch.float32).tolist()


# --------------------------------------------------------------------------- build_tree: the fused op
def select_nodes(parents: Tensor, scores: Tensor, n_keep: int, log_tau: float) -> Tensor:
    """Pool ids of the best ``n_keep`` nodes scoring >= log_tau, closed under parents, in pool order.

    Ranking: score descending, equal scores -> lower pool id first (a stable sort). A child never
    outscores its parent (log p <= 0) and ties keep the parent (lower id) first, so the top scores
    already form a tree; the closure pass only matters for pools that break that rule.
    """
    if n_keep <= 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    eligible = scores >= log_tau          # the Python float is rounded to float32, as in the kernel
    order = torch.argsort(torch.where(eligible, scores, -torch.inf), descending=True, stable=True)
    chosen = order[:n_keep][eligible[order[:n_keep]]]
    parent_of = parents.tolist()  # one transfer, then a host walk over <= N-1 nodes
    kept: set[int] = set()
    for i in chosen.sort().values.tolist():  # pool order = parents first
        if parent_of[i] < 0 or parent_of[i] in kept:
            kept.add(i)
    return torch.tensor(sorted(kept), dtype=torch.long, device=scores.device)


def draft_as_tree(tokens: Tensor, parents: Tensor, scores: Tensor, depths: Tensor, keep: Tensor,
                  root_token: int | Tensor) -> Tree:
    """Root + the pool entries ``keep`` (pool order) as a Tree."""
    device = tokens.device
    remap = torch.full((tokens.shape[0],), -1, dtype=torch.long, device=device)
    remap[keep] = torch.arange(1, keep.shape[0] + 1, device=device)
    kept_parents = parents[keep].long()
    tree_parents = torch.where(kept_parents < 0, 0, remap[kept_parents.clamp(min=0)])
    n = keep.shape[0] + 1
    source = torch.full((n,), DRAFT, dtype=torch.int8, device=device)
    source[0] = ROOT
    return Tree(
        tokens=torch.cat([torch.as_tensor(root_token, dtype=torch.int64, device=device).reshape(1), tokens[keep]]),
        parents=torch.cat([torch.tensor([-1], device=device), tree_parents]).to(torch.int32),
        depth=torch.cat([torch.zeros(1, dtype=torch.long, device=device), depths[keep].long()]).to(torch.int32),
        source=source,
        scores=torch.cat([torch.zeros(1, device=device), scores[keep].float()]),
    )


def build_tree(pool_tokens: Tensor, pool_parents: Tensor, pool_scores: Tensor, pool_depth: Tensor,
               n_pool: Tensor, roots: Tensor, log_tau: Tensor, cand_tokens: Tensor, cand_parents: Tensor,
               cand_source: Tensor, budget_n: int, pool_values: Tensor | None = None,
               cand_values: Tensor | None = None) -> BuiltTree:
    """Per row b: prune + rerank the drafter's pool, graft the candidates, give the budget to the
    likeliest nodes, emit the tree tensors.

    Parameters
    ----------
    pool_tokens : int64 [B, P]      drafted candidates in creation order (as ``drafting`` builds them)
    pool_parents : int64 [B, P]     -1 = child of the root, else an earlier pool index
    pool_scores : float32 [B, P]    cumulative drafter log-prob
    pool_depth : int [B, P]         depth of each entry (root children: 1)
    n_pool : int64 [B]              only entries ``< n_pool[b]`` are valid (P may be larger)
    roots : int64 [B]               each row's last committed token
    log_tau : float32 [B]           keep pool entries scoring >= log_tau (-inf: keep all)
    cand_tokens : int64 [B, C]      grafted candidates, -1 = missing (e.g. prompt-lookup chain + template)
    cand_parents : int32 [C]        -1 = child of the root, else an earlier candidate index (every row alike)
    cand_source : int8 [C] or [B, C] source code of each candidate (DRAFT, RETRIEVAL, PROMPT_LOOKUP),
                                    every row alike or each row its own
    budget_n : int                  N, nodes in each tree including the root, >= 1
    pool_values : float32 [B, P]    estimated log P(accepted) of each pool entry (None: all 0)
    cand_values : float32 [B, C]    estimated log P(accepted | parent accepted, no drafted sibling accepted)
                                    of each candidate (None: all 0; see ``free_share``)

    Returns
    -------
    BuiltTree of fixed shapes, a leading batch dim on every field (see its docstring).

    Semantics: the pool entries scoring >= log_tau, the best N-1 by score (equal scores: lower
    pool index first), closed under parents, are the drafted candidates (``select_nodes``); they
    and the grafted candidates then compete for the N - 1 places by estimated acceptance
    (``allocate``). With no values given every node ties, so the drafted nodes are kept and the
    candidates fill what is left in index order. CPU reference: host loops over the rows, syncs;
    the kernel does the same on device in one launch.
    """
    B, P = pool_tokens.shape
    C = cand_tokens.shape[-1]
    if not isinstance(budget_n, int) or budget_n < 1:
        raise ValueError(f"budget_n must be an int >= 1, got {budget_n!r}")
    if pool_tokens.dim() != 2 or any(t.shape != (B, P) for t in (pool_parents, pool_scores, pool_depth)):
        raise ValueError(f"pool tensors must be [B, P] of one shape, got {list(pool_tokens.shape)}")
    if n_pool.shape != (B,) or roots.shape != (B,) or log_tau.shape != (B,):
        raise ValueError(f"n_pool, roots and log_tau must be [B={B}]")
    if cand_tokens.shape != (B, C) or cand_parents.shape != (C,) or cand_source.shape not in ((C,), (B, C)):
        raise ValueError(f"cand_tokens must be [B={B}, C], cand_parents [C={C}], cand_source [C] or [B, C]")
    cand_source = cand_source.expand(B, C)
    if pool_values is not None and pool_values.shape != (B, P):
        raise ValueError(f"pool_values must be [B={B}, P={P}], got {list(pool_values.shape)}")
    if cand_values is not None and cand_values.shape != (B, C):
        raise ValueError(f"cand_values must be [B={B}, C={C}], got {list(cand_values.shape)}")
    n_host, tau_host = n_pool.tolist(), log_tau.tolist()
    rows = [_build_row(pool_tokens[b], pool_parents[b], pool_scores[b], pool_depth[b], n_host[b], roots[b],
                       tau_host[b], cand_tokens[b], cand_parents, cand_source[b], budget_n,
                       None if pool_values is None else pool_values[b],
                       None if cand_values is None else cand_values[b]) for b in range(B)]
    return BuiltTree(*(torch.stack(field) for field in zip(*rows)))


def _build_row(pool_tokens: Tensor, pool_parents: Tensor, pool_scores: Tensor, pool_depth: Tensor, n: int,
               root: Tensor, log_tau: float, cand_tokens: Tensor, cand_parents: Tensor, cand_source: Tensor,
               budget_n: int, pool_values: Tensor | None, cand_values: Tensor | None) -> BuiltTree:
    """``build_tree`` of one row (unbatched fields)."""
    P = pool_tokens.shape[0]
    if not 0 <= n <= P:
        raise ValueError(f"n_pool must be in [0, P={P}], got {n}")
    keep = select_nodes(pool_parents[:n], pool_scores[:n], budget_n - 1, log_tau)
    draft = draft_as_tree(pool_tokens, pool_parents, pool_scores, pool_depth, keep, root)
    draft_values = None
    if pool_values is not None:
        draft_values = torch.cat([torch.zeros(1, device=pool_values.device), pool_values[keep].float()])
    tree, cand_node, kept_drafted, values = allocate(draft, cand_tokens, cand_parents, cand_source, budget_n,
                                                     draft_values, cand_values)

    N, m, dev = budget_n, tree.n, pool_tokens.device

    def pad(t: Tensor, value, dtype) -> Tensor:
        return torch.cat([t.to(dtype), torch.full((N - m,), value, dtype=dtype, device=dev)])

    mask = torch.eye(N, dtype=torch.bool, device=dev)      # padding rows hold only their own bit
    mask[:m, :m] = tree.attn_mask()
    # Kept drafted nodes come first after the root (union order); draft node i is pool entry keep[i - 1].
    pool_index = torch.full((N,), -1, dtype=torch.int64, device=dev)
    pool_index[1:1 + len(kept_drafted)] = keep[torch.tensor(kept_drafted, dtype=torch.long, device=dev) - 1]
    return BuiltTree(tokens=pad(tree.tokens, -1, torch.int64), parents=pad(tree.parents, -1, torch.int32),
                     depth=pad(tree.depth, 0, torch.int32), source=pad(tree.source, -1, torch.int8),
                     scores=pad(tree.scores, float("-inf"), torch.float32), pool_index=pool_index, mask=pack_mask(mask),
                     n_nodes=torch.tensor(m, dtype=torch.int64, device=dev),
                     cand_node=torch.tensor(cand_node, dtype=torch.int32, device=dev),
                     values=pad(torch.tensor(values, dtype=torch.float32, device=dev), float("-inf"), torch.float32))
