"""Acceptance of a verified tree: which path the target agrees with, plus one bonus token.

Greedy: walk from the root, following the child whose token is the target's argmax at the
current node; the argmax at the last accepted node is the bonus token. Output equals plain greedy
decoding exactly.

Sampling (lossless for candidates fixed before the target's random draw; DESIGN.md §1 step 8):
at node u with target distribution p, try each distinct child c in turn: accept with probability
p(c); on rejection set p(c) = 0 and renormalise. When no child is accepted, the bonus token is
drawn from what is left of p.

``accept`` is the op both backends share (``graft_tk.kernels.accept`` has the same signature):
greedy or sampling with pre-drawn uniforms in exact integer arithmetic, fused with the
successor-matrix update, fixed-size outputs and no host sync. ``greedy_accept`` is the
step-by-step greedy definition it is tested against (tests/test_kernel_accept.py holds the
sequential sampling one).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..sampling import truncated_probs
from ..tree import Tree
from ..adjacency import update_adjacency


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


# --------------------------------------------------------------------------- fused accept + M update
# Sampling in exact integer arithmetic, so the Triton kernel and this reference agree bit for bit
# whatever order their reductions run in (float sums over V would differ between a block-reduction
# and torch's sum). Probabilities become integers in units of 2**-38 and uniforms in units of
# 2**-24 (torch.rand's float32 resolution: u == U * 2**-24 exactly). Products stay below 2**63:
# U * mass < 2**24 * 2**38 (1 + 1e-6) and q << 24 likewise.
PROB_BITS = 38
UNIFORM_BITS = 24


def quantize_probs(probs: Tensor) -> Tensor:
    """float32 probabilities -> int64 multiples of 2**-38, truncated (``p * 2**38`` is exact in fp32)."""
    return (probs * float(2 ** PROB_BITS)).to(torch.int64)


def quantize_uniforms(uniforms: Tensor) -> Tensor:
    """float32 uniforms in [0, 1) -> int64 U in [0, 2**24), ``u == U * 2**-24`` for torch.rand's draws."""
    return (uniforms.to(torch.float32) * float(2 ** UNIFORM_BITS)).to(torch.int64).clamp(0, 2 ** UNIFORM_BITS - 1)


def accept(tree: Tree, logits: Tensor, adj: Tensor | None, temperature: float, top_p: float,
           uniforms: Tensor | None = None, generator: torch.Generator | None = None
           ) -> tuple[Tensor, Tensor, Tensor]:
    """Acceptance (greedy or lossless sampling) fused with the successor-matrix update.

    Parameters
    ----------
    tree : Tree
        The verified tree, N nodes.
    logits : Tensor, float32 [N, V]
        Target logits at every node.
    adj : Tensor, int32 [V, k], or None
        The successor matrix M, updated in place: ``adj[tokens[i]] = topk(logits[i], k)`` for every
        node in the engine's write order (non-path nodes by index, then the accepted path root
        first); a token at several nodes gets the row of the last writer in that order. None:
        no update (methods that never read M).
    temperature : float
        0 = greedy (then ``top_p``, ``uniforms`` and ``generator`` are ignored).
    top_p : float
        Nucleus cut (``graft_tk.sampling.truncated_probs``).
    uniforms : Tensor, float32 [N], optional
        Pre-drawn uniforms in [0, 1): ``uniforms[c]`` decides child c when it is tried,
        ``uniforms[0]`` (the root is nobody's child) draws the bonus. Default: ``torch.rand(N)``
        from ``generator``.

    Returns
    -------
    path : Tensor, int64 [N]
        Accepted node indices, root first, padded with -1.
    n_path : Tensor, int64 []
        Nodes on the path, root included.
    bonus : Tensor, int64 []
        The token after the path: the argmax at the last accepted node (greedy), or a draw from
        the residual distribution there (sampling).

    Sampling rule (DESIGN.md §1 step 8, in integers): at node u with q = quantize_probs of u's
    nucleus-truncated probabilities and residual mass Q (initially sum(q): the renormalisation
    is this integer sum, exact), children are tried in index order; child c is accepted iff
    ``U[c] * Q < q[c] * 2**24`` (i.e. u_c < q[c] / Q), else Q -= q[c]. When none is accepted,
    the bonus is the first token x with ``cumsum(r)[x] * 2**24 > U[0] * R``, where r is q with
    u's children zeroed and R = sum(r) (inverse CDF). Each acceptance probability is the exact
    ratio of the quantized distribution up to the 2**-24 grid of U; tokens with p < 2**-38 are
    never drawn.

    Greedy is vectorised over all nodes (no host sync). Sampling walks from the root and computes
    the target distribution only at the nodes it visits (the accepted path, at most depth + 1
    rows), reading a few scalars per level: the CPU path, where a host read is free. The Triton
    kernel decides every node at once from all N rows; both give the same bits.
    """
    n, vocab = logits.shape
    if tree.n != n:
        raise ValueError(f"logits must be [N={tree.n}, V], got {list(logits.shape)}")
    device = logits.device
    idx = torch.arange(n, device=device)
    if temperature == 0.0:
        argmax = logits.argmax(-1)                                          # ties: lowest index
        chosen = tree.tokens == argmax[tree.parents.long().clamp(min=0)]
        chosen[0] = True                                                    # the root is committed
        mask = tree.attn_mask()                                             # [N, N] ancestor-or-self
        reached = ~(mask & ~chosen[None, :]).any(-1)
        # unique: <= 1 chosen child per node; [1]-shaped: a gather, never a host read of the index
        last = torch.where(reached, tree.depth.long(), -1).argmax().view(1)
        on_path = mask[last][0]
        bonus = argmax[last][0]
    else:
        if uniforms is None:
            uniforms = torch.rand(n, generator=generator, device=device)
        on_path, last, bonus = _sampling_walk(tree, logits, temperature, top_p, quantize_uniforms(uniforms))
    # path[depth[j]] = j for every j on the path; off-path nodes all write the spare slot n.
    path = torch.full((n + 1,), -1, dtype=torch.int64, device=device)
    path = path.scatter_(0, torch.where(on_path, tree.depth.long(), n), idx)[:n]
    n_path = tree.depth[last.view(1)][0].long() + 1
    if adj is not None:   # M update in the engine's order: non-path nodes by index, then the path root first
        update_adjacency(adj, tree.tokens, logits, torch.argsort(on_path.long() * n + idx))
    return path, n_path, bonus


def _sampling_walk(tree: Tree, logits: Tensor, temperature: float, top_p: float, u: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """(on_path bool [N], last node int64 [], bonus int64 []): the sampling rule, one visited row at a time."""
    n, vocab = logits.shape
    device = logits.device
    tokens, parents, uq = tree.tokens.tolist(), tree.parents.tolist(), u.tolist()
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        if parents[i] >= 0:               # -1 past the root: padding, nobody's child
            kids[parents[i]].append(i)
    on_path = [0]
    while True:
        node = on_path[-1]
        q = quantize_probs(truncated_probs(logits[node:node + 1], temperature, top_p)[0])   # int64 [V]
        if not kids[node]:
            break
        q_kids = q[tree.tokens[kids[node]]].tolist()
        left, nxt = int(q.sum()), -1
        for c, qc in zip(kids[node], q_kids):
            if uq[c] * left < qc << UNIFORM_BITS:
                nxt = c
                break
            left -= qc
        if nxt < 0:
            break
        on_path.append(nxt)
    residual = q.clone()
    residual[[tokens[c] for c in kids[node]]] = 0
    threshold = uq[0] * int(residual.sum())
    bonus = ((residual.cumsum(0) << UNIFORM_BITS) > threshold).long().argmax()   # first crossing
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    mask[on_path] = True
    return mask, torch.tensor(node, device=device), bonus
