"""The token-successor adjacency matrix M and the retrieval template: state the engine owns and
every backend reads.

M (``adj``) is int32 [V, k]: row t holds the k tokens the target last ranked most likely after
token t, best first; -1 marks a row never written. It lives on the device and is updated from
every verification pass (``update_adjacency``: the rule the Triton accept kernel also follows),
so retrieval needs no drafter forward.

Retrieval (``ops.retrieve``) walks a static template of rank paths from the root token: template
node i takes column ``ranks[i]`` of the row of its parent's token. Worked example (k = 2)::

    M[5] = [7, 9]   M[7] = [3, -1]   M[9] = [-1, -1]     root token 5
    template  parents [-1, -1, 0, 0, 1]   ranks [0, 1, 0, 1, 0]   (levels [0, 2) and [2, 5))
    retrieve -> [7, 9, 3, -1, -1]   (node 3 hits an empty column, node 4 an empty row)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor


# --------------------------------------------------------------------------- adjacency matrix
def new_adjacency(vocab_size: int, k: int, device: torch.device | str = "cpu") -> Tensor:
    """An empty successor matrix: int32 [vocab_size, k] filled with -1."""
    if vocab_size < 1 or not 1 <= k <= vocab_size:
        raise ValueError(f"need vocab_size >= 1 and 1 <= k <= vocab_size, got vocab_size={vocab_size}, k={k}")
    return torch.full((vocab_size, k), -1, dtype=torch.int32, device=device)


def update_adjacency(adj: Tensor, tokens: Tensor, logits: Tensor, order: Tensor | None = None) -> Tensor:
    """Write ``adj[tokens[i]] = topk(logits[i], k).indices`` for every node, in place (padding
    nodes, token -1, write nothing).

    Parameters
    ----------
    adj : Tensor, int32 [V, k]
        The successor matrix, updated in place and returned.
    tokens : Tensor, int64 [N]
        Token of each node (tree nodes, or prompt positions).
    logits : Tensor, float [N, V]
        Target logits at each node: the distribution of the token that follows ``tokens[i]``.
    order : Tensor, int64 [N], optional
        A permutation of 0..N-1 giving the write order; default 0..N-1.

    Notes
    -----
    A token can occur at several nodes (siblings' subtrees repeat tokens); the row it gets must
    not depend on scatter races. Later nodes in ``order`` win. The engine passes the accepted
    path last: its logits were computed in the context that is now the committed text, so they
    are the freshest predictor of what follows that token next time; a rejected branch's view
    is about a continuation that did not happen.

    Implementation: stable-sort the tokens in write order, find the last writer of each run
    of equal tokens, and let every duplicate write that winner's row, so duplicate scatter
    writes carry identical values. O(N log N), static shapes, no host sync.
    """
    n = tokens.shape[0]
    if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] != adj.shape[0]:
        raise ValueError(f"logits must be [N={n}, V={adj.shape[0]}] to match tokens and adj, got {list(logits.shape)}")
    if n == 0:
        return adj
    return write_successors(adj, tokens, torch.topk(logits, adj.shape[1], dim=-1).indices, order)


def write_successors(adj: Tensor, tokens: Tensor, top: Tensor, order: Tensor | None = None) -> Tensor:
    """``adj[tokens[i]] = top[i]`` for every node, by the write-order rule of ``update_adjacency``
    (later in ``order`` wins, padding writes nothing); top: int [N, k], each node's successors."""
    n = tokens.shape[0]
    if n == 0:
        return adj
    top = top.to(torch.int32)
    if order is None:
        order = torch.arange(n, device=tokens.device)
    order = order[tokens[order] >= 0]     # padding nodes (token -1) write nothing (the kernel masks them)
    n = order.shape[0]
    tok = tokens[order]                                                      # write sequence
    sorted_tok, perm = torch.sort(tok, stable=True)                          # equal tokens keep write order
    new_run = torch.ones_like(sorted_tok, dtype=torch.bool)
    new_run[1:] = sorted_tok[1:] != sorted_tok[:-1]
    run_id = torch.cumsum(new_run.long(), 0) - 1                             # [N] run of each sorted slot
    slot = torch.arange(n, device=tokens.device)
    run_last = torch.zeros(n, dtype=torch.long, device=tokens.device).scatter_reduce(
        0, run_id, slot, reduce="amax", include_self=False)                  # last sorted slot per run
    winner = order[perm[run_last[run_id]]]                                   # node whose row each slot writes
    adj[sorted_tok] = top[winner]
    return adj


WARM_LOGITS_PER_CHUNK = 1 << 25   # fp32 logits held at once while warming from a prompt (128 MB)


def warm_adjacency(adj: Tensor, prompt_tokens: Tensor, hidden: Tensor, head: Callable[[Tensor], Tensor]) -> Tensor:
    """Fill ``adj`` from prefill: position t's logits give the successors of ``prompt_tokens[t]``.

    prompt_tokens: int64 [T]; hidden: [T, ...], what ``head`` turns into logits [rows, V] (the
    target's last-layer states and its norm + LM head, ``Transformer.logits``; or the logits
    themselves and an identity head). The logits are made and ranked a chunk of positions at a
    time, so a long prompt never holds all of them: a 4k-token prompt over Qwen's 151,936-token
    vocabulary is 2.5 GB of fp32 logits, a chunk at most 128 MB. Later positions win, the
    freshest-context rule of ``update_adjacency``. Returns ``adj`` (updated in place).
    """
    n, (V, k) = prompt_tokens.shape[0], adj.shape
    rows = max(1, WARM_LOGITS_PER_CHUNK // V)
    tops = []
    for i in range(0, n, rows):
        logits = head(hidden[i:i + rows])
        if logits.dim() != 2 or logits.shape[1] != V:
            raise ValueError(f"logits must be [rows, V={V}] to match adj, got {list(logits.shape)}")
        tops.append(torch.topk(logits, k, dim=-1).indices)
    return write_successors(adj, prompt_tokens, torch.cat(tops)) if tops else adj


# --------------------------------------------------------------------------- template
@dataclass(frozen=True, eq=False)
class RetrievalTemplate:
    """A static tree of rank paths, T nodes in BFS order (the root itself is not a node).

    Attributes
    ----------
    parents : Tensor, int32 [T]
        Template parent of each node; -1 = child of the root. Parents precede children.
    ranks : Tensor, int32 [T]
        Column of M the node takes from its parent's row, in [0, k).
    k : int
        Columns of the M this template reads.
    depth : Tensor, int32 [T]
        Computed: 1 for children of the root.
    levels : tuple[tuple[int, int], ...]
        Computed: host [start, end) of each depth, so ``retrieve`` loops over a static count.
    rank_paths : Tensor, int32 [T, max(len(levels), 1)]
        Computed: row i = the ranks on the path root -> node i (column d = the rank taken at
        depth d + 1), padded with -1 after ``depth[i]`` entries. It lets a kernel walk every node
        from the root independently, all levels in one launch (``graft_tk.kernels.retrieve``).
        Example: parents [-1, -1, 0], ranks [0, 1, 1] -> rank_paths [[0, -1], [1, -1], [0, 1]].
    """

    parents: Tensor
    ranks: Tensor
    k: int
    depth: Tensor = field(init=False)
    levels: tuple[tuple[int, int], ...] = field(init=False)
    rank_paths: Tensor = field(init=False)

    def __post_init__(self) -> None:
        parents = torch.as_tensor(self.parents).to(torch.int32)
        ranks = torch.as_tensor(self.ranks).to(torch.int32).to(parents.device)
        if parents.dim() != 1 or ranks.shape != parents.shape:
            raise ValueError(f"parents and ranks must be 1-D of equal length, got {list(parents.shape)} "
                             f"and {list(ranks.shape)}")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an int >= 1, got {self.k!r}")
        par, rk = parents.tolist(), ranks.tolist()
        depth: list[int] = []
        seen: set[tuple[int, int]] = set()
        for i, (p, r) in enumerate(zip(par, rk)):
            if not -1 <= p < i:
                raise ValueError(f"template node {i} has parent {p}; need -1 (root) or an earlier node")
            if not 0 <= r < self.k:
                raise ValueError(f"template node {i} has rank {r}; ranks must be in [0, k={self.k})")
            if (p, r) in seen:
                raise ValueError(f"template node {i} repeats (parent {p}, rank {r})")
            seen.add((p, r))
            depth.append(1 if p < 0 else depth[p] + 1)
            if i > 0 and (depth[i] < depth[i - 1] or p < par[i - 1]):
                raise ValueError(f"template node {i} (depth {depth[i]}, parent {p}) breaks BFS order after "
                                 f"node {i - 1} (depth {depth[i - 1]}, parent {par[i - 1]})")
        paths: list[list[int]] = []
        for p, r in zip(par, rk):
            paths.append((paths[p] if p >= 0 else []) + [r])
        width = max(len(set(depth)), 1)
        bounds = [i for i in range(1, len(depth)) if depth[i] != depth[i - 1]]
        starts, ends = [0] + bounds, bounds + [len(depth)]
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "depth", torch.tensor(depth, dtype=torch.int32, device=parents.device))
        object.__setattr__(self, "levels", tuple(zip(starts, ends)) if depth else ())
        object.__setattr__(self, "rank_paths", torch.tensor([q + [-1] * (width - len(q)) for q in paths],
                                                            dtype=torch.int32, device=parents.device
                                                            ).reshape(len(paths), width))

    @property
    def n(self) -> int:
        return self.parents.shape[0]

    def level_sizes(self) -> list[int]:
        return [e - s for s, e in self.levels]

    def to(self, device: torch.device | str) -> "RetrievalTemplate":
        """The same template on ``device`` (move it once, not per step)."""
        return RetrievalTemplate(self.parents.to(device), self.ranks.to(device), self.k)


def template_from_level_sizes(sizes: Sequence[int], k: int) -> RetrievalTemplate:
    """Build a template with ``sizes[d]`` nodes at depth d + 1, favouring low ranks.

    A candidate node costs the sum of the ranks on its path (rank r ~ the r-th most likely
    successor, so a smaller sum ~ a likelier path). Each level takes the ``sizes[d]`` cheapest
    children of the previous level, ties broken by (parent, rank); because cost grows with rank,
    every parent's children are ranks 0..m-1 and parents with cheaper paths get more of them.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    parents: list[int] = []
    ranks: list[int] = []
    frontier = [(-1, 0)]  # (node index, path cost); -1 = the root
    for d, size in enumerate(sizes):
        if not isinstance(size, int) or not 1 <= size <= len(frontier) * k:
            raise ValueError(f"level {d + 1} size must be an int in [1, {len(frontier) * k}] "
                             f"({len(frontier)} parents x k={k}), got {size!r}")
        cands = sorted((cost + r, p, r) for p, cost in frontier for r in range(k))[:size]
        cands.sort(key=lambda c: (c[1], c[2]))  # BFS order: grouped by parent, then rank
        frontier = []
        for cost, p, r in cands:
            frontier.append((len(parents), cost))
            parents.append(p)
            ranks.append(r)
    return RetrievalTemplate(torch.tensor(parents, dtype=torch.int32), torch.tensor(ranks, dtype=torch.int32), k)


DEFAULT_LEVEL_SIZES = (8, 21, 25, 15, 8, 3)  # Token Recycling's 80-node template


def default_template(k: int = 8) -> RetrievalTemplate:
    """The Token-Recycling-like 80-node template, level sizes 8/21/25/15/8/3."""
    return template_from_level_sizes(DEFAULT_LEVEL_SIZES, k)
