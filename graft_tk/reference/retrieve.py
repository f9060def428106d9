"""Root-parallel retrieval (Token Recycling) in torch: one gather per template level.

The matrix M and the template it walks are in ``graft_tk.adjacency`` (worked example there).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..adjacency import RetrievalTemplate


# --------------------------------------------------------------------------- retrieval
def retrieve(adj: Tensor, root_token: Tensor, template: RetrievalTemplate) -> Tensor:
    """Tokens of every template node, walked from ``root_token`` through ``adj``.

    Parameters
    ----------
    adj : Tensor, int32 [V, k]
        The successor matrix, ``k >= template.k``.
    root_token : Tensor, int64 [] or [1]
        The last committed token.
    template : RetrievalTemplate
        T nodes in BFS order, on ``adj``'s device (see ``RetrievalTemplate.to``).

    Returns
    -------
    Tensor, int64 [T]
        Token of each template node; -1 where the parent's token is -1 or the M entry is empty,
        so a missing node's whole subtree is -1. One gather per level, no host sync.
    """
    if adj.shape[1] < template.k:
        raise ValueError(f"template reads k={template.k} columns but adj has only {adj.shape[1]}")
    root = root_token.reshape(1).to(torch.int64)
    out = torch.full((template.n,), -1, dtype=torch.int64, device=adj.device)
    for start, end in template.levels:
        par = template.parents[start:end].long()
        # Parents of a level lie in earlier levels, already written; -1 parents read the root.
        ptok = torch.where(par < 0, root, out[par.clamp(min=0)])
        tok = adj[ptok.clamp(min=0), template.ranks[start:end].long()].to(torch.int64)
        out[start:end] = torch.where(ptok < 0, -1, tok)
    return out
