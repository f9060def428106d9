"""Acceptance of a batch of verified trees: which path each target agrees with, plus one bonus token.

Each node's *choice* is the token the target picks after that node's path (``graft_tk.sampling
.choose``: the argmax, or the seeded draw at its position). A node is accepted when every node on
its path, itself included, is the choice of its parent; the accepted path is the deepest such node
and its ancestors (siblings carry distinct tokens, so at most one child of a node can agree), and
the bonus token is the choice at its last node. Greedy and sampled decoding share this rule; the
choice alone differs. The output equals plain decoding with the same choices exactly.

``accept`` is the op both backends share (``graft_tk.kernels.accept`` has the same signature):
vectorised over rows and nodes, fused with the successor-matrix update, fixed-size outputs and
no host read. ``greedy_accept`` is the step-by-step definition it is tested against.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..adjacency import update_adjacency
from ..tree import Tree, unpack_mask


def greedy_accept(tree: Tree, choice: Tensor) -> tuple[list[int], int]:
    """The definition, one tree, on the host: walk from the root, following the child whose token
    is the current node's choice; (path node indices root first, bonus token)."""
    tokens, parents, choice = tree.tokens.tolist(), tree.parents.tolist(), choice.tolist()
    path = [0]
    while True:
        kids = [i for i in range(1, tree.n) if parents[i] == path[-1] and tokens[i] == choice[path[-1]]]
        if not kids:
            return path, choice[path[-1]]
        path.append(kids[0])


def accept(tokens: Tensor, parents: Tensor, depth: Tensor, mask: Tensor, choice: Tensor, logits: Tensor | None,
           adj: Tensor | None, writes: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Acceptance of B trees of N nodes (``BuiltTree``'s fields), fused with the M update.

    Parameters
    ----------
    tokens, parents, depth : Tensor [B, N]
        The trees (int64, int32, int32): parents before children, padding has token -1 and parent -1.
    mask : Tensor, int32 [B, N, ceil(N / 32)]
        Packed ancestor-or-self bits (``graft_tk.tree.pack_mask``).
    choice : Tensor, int64 [B, N]
        The target's token after each node (``graft_tk.sampling.choose``).
    logits : Tensor, float32 [B, N, V], or None
        Target logits at every node: what M's rows are updated from (None with ``adj`` None).
    adj : Tensor, int32 [V, k], or None
        The successor matrix M, updated in place: ``adj[tokens[b, i]] = topk(logits[b, i], k)``
        for every node of every row whose ``writes[b]``, in the write order rows 0 .. B - 1, within
        a row non-path nodes by index, then the accepted path root first; a token at several nodes
        gets the row of the last writer. None: no update.
    writes : Tensor, bool [B], optional
        Rows whose method reads M (default: all).

    Returns
    -------
    path : Tensor, int64 [B, N]
        Accepted node indices, root first, padded with -1.
    n_path : Tensor, int64 [B]
        Nodes on the path, root included.
    bonus : Tensor, int64 [B]
        The choice at the last accepted node.
    """
    B, N = tokens.shape
    device = tokens.device
    if choice.shape != (B, N) or parents.shape != (B, N) or depth.shape != (B, N):
        raise ValueError(f"tokens, parents, depth and choice must all be [B={B}, N={N}]")
    idx = torch.arange(N, device=device)
    agrees = tokens == choice.gather(1, parents.long().clamp(min=0))     # padding (token -1) never agrees
    agrees[:, 0] = True                                                   # the root is committed
    anc = unpack_mask(mask, N)                                            # [B, N, N] ancestor-or-self
    reached = ~(anc & ~agrees[:, None, :]).any(-1)
    # unique: <= 1 agreeing child per node; [B, 1]-shaped gathers, never a host read of an index
    last = torch.where(reached, depth.long(), -1).argmax(-1, keepdim=True)              # [B, 1]
    on_path = anc.gather(1, last[:, :, None].expand(-1, -1, N))[:, 0]                   # [B, N]
    bonus = choice.gather(1, last)[:, 0]
    # path[b, depth[j]] = j for every j on the path; off-path nodes all write the spare column N.
    path = torch.full((B, N + 1), -1, dtype=torch.int64, device=device)
    path.scatter_(1, torch.where(on_path, depth.long(), N), idx.expand(B, -1))
    n_path = depth.long().gather(1, last)[:, 0] + 1
    if adj is not None:   # rows in order; in a row non-path nodes by index, then the path root first
        writers = tokens if writes is None else torch.where(writes[:, None], tokens, -1)
        order = ((torch.arange(B, device=device)[:, None] * 2 + on_path.long()) * N + idx).reshape(-1).argsort()
        update_adjacency(adj, writers.reshape(-1), logits.reshape(B * N, -1), order)
    return path[:, :N], n_path, bonus
