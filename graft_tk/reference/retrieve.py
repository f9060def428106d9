"""Root-parallel retrieval (Token Recycling) in torch: one gather per template level.

The matrix M and the template it walks are in ``graft_tk.adjacency`` (worked example there).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..adjacency import RetrievalTemplate


# --------------------------------------------------------------------------- retrieval
def retrieve(adj: Tensor, roots: Tensor, template: RetrievalTemplate) -> Tensor:
    """Tokens of every template node, walked from each row's root through ``adj``.

    Parameters
    ----------
    adj : Tensor, int32 [V, k]
        The successor matrix, ``k >= template.k``.
    roots : Tensor, int64 [B]
        The last committed token of each row.
    template : RetrievalTemplate
        T nodes in BFS order, on ``adj``'s device (see ``RetrievalTemplate.to``).

    Returns
    -------
    Tensor, int64 [B, T]
        Token of each template node; -1 where the parent's token is -1 or the M entry is empty,
        so a missing node's whole subtree is -1. One gather per level, no host sync.
    """
    if adj.shape[1] < template.k:
        raise ValueError(f"template reads k={template.k} columns but adj has only {adj.shape[1]}")
    if roots.dim() != 1:
        raise ValueError(f"roots must be [B], got {list(roots.shape)}")
    root = roots.to(torch.int64)[:, None]
    out = torch.full((roots.shape[0], template.n), -1, dtype=torch.int64, device=adj.device)
    for start, end in template.levels:
        par = template.parents[start:end].long()
        # Parents of a level lie in earlier levels, already written; -1 parents read the root.
        ptok = torch.where(par < 0, root, out[:, par.clamp(min=0)])
        tok = adj[ptok.clamp(min=0), template.ranks[start:end].long()].to(torch.int64)
        out[:, start:end] = torch.where(ptok < 0, -1, tok)
    return out
