"""Acceptance of a verified tree: which path the target agrees with, plus one bonus token.

Greedy: walk from the root, following the child whose token is the target's argmax at the
current node; the argmax at the last accepted node is the bonus token. Output equals plain greedy
decoding exactly.

Sampling (lossless for candidates fixed before the target's random draw; DESIGN.md §1 step 8):
at node u with target distribution p, try each distinct child c in turn: accept with probability
p(c); on rejection set p(c) = 0 and renormalise. When no child is accepted, the bonus token is
drawn from what is left of p.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..sampling import target_probs
from ..tree import Tree


def greedy_accept(tree: Tree, logits: Tensor) -> tuple[Tensor, Tensor]:
    """tree of N nodes, target logits float32 [N, V] -> (path int64 [m+1] root first, bonus int64 []).

    Vectorised: node i "agrees" when its token is the argmax at its parent; the accepted path is
    the deepest node all of whose ancestors agree (siblings carry distinct tokens, so at most one
    child of a node agrees and the deepest such node is unique).
    """
    argmax = logits.argmax(-1)                                              # [N]
    parents = tree.parents.long().clamp(min=0)
    agrees = tree.tokens == argmax[parents]
    agrees[0] = True                                                        # the root is committed
    mask = tree.attn_mask()                                                 # [N, N] ancestor-or-self
    on_path = ~(mask & ~agrees[None, :]).any(-1)                            # all ancestors agree
    depth = torch.where(on_path, tree.depth.long(), torch.full_like(tree.depth.long(), -1))
    last = depth.argmax()
    path = mask[last].nonzero().squeeze(-1)                                 # ancestors in index order
    return path, argmax[last]


def sample_accept(tree: Tree, logits: Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Lossless multi-candidate acceptance at temperature > 0; same outputs as greedy_accept."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children: dict[int, list[int]] = {}
    for i in range(1, len(tokens)):
        children.setdefault(parents[i], []).append(i)
    path, u = [0], 0
    while True:
        p = target_probs(logits[u], temperature, top_p)
        for c in children.get(u, []):
            r = torch.rand((), generator=generator, device=p.device)
            if r < p[tokens[c]]:
                u = c
                break
            p[tokens[c]] = 0.0
            mass = p.sum()
            if mass <= 0:  # p(c) was 1 up to rounding and r landed in the rounding gap
                u = c
                break
            p = p / mass
        else:
            bonus = torch.multinomial(p, 1, generator=generator).squeeze(0)
            return torch.tensor(path, device=logits.device), bonus
        path.append(u)
