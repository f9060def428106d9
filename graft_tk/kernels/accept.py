"""Acceptance (greedy and lossless sampling) fused with the successor-matrix update: TWO launches.

Same signature and outputs as ``graft_tk.reference.accept.accept``; read its docstring for the
rule. The work splits where a grid-wide dependency forces it:

1. ``_node_topk_kernel``, one program per tree node: one pass over the node's V logits in
   BLOCK_V chunks keeping a running top-k (value desc, index asc), so the argmax is its first
   entry. Sampling also sums the node's quantized probabilities (the residual mass at the start
   of its children's trials). Every node is independent: N programs in parallel.
2. ``_walk_kernel``, one program: walk from the root (greedy: the child whose token is the
   parent's argmax; sampling: the first child, in index order, whose uniform beats its residual
   probability), draw the sampling bonus by inverse CDF over V, and write M's rows. It needs
   every node's argmax / top-k / mass, hence the second launch.

Exactness with the reference. Greedy: argmax and top-k are comparisons, no arithmetic, so the
only question is ties: both take the lowest index (``torch.argmax`` does; ``torch.topk`` on CPU
orders tied values arbitrarily, so tests keep the top-k ranks untied). Sampling: the target
probabilities come from ``graft_tk.sampling.truncated_probs`` computed in torch before launch 1
(softmax and the top-p nucleus are not re-implemented here), then both sides quantize them
elementwise to int64 and do every sum, comparison and inverse-CDF step in integers — order
independent, so a block-reduction here and torch's sum there give identical bits. The only float
operation left, ``p * 2**38`` (and ``u * 2**24``), is one exact multiply by a power of two, so
FP fusion (on by default in Triton 3.9) has nothing to contract.

M update (last-writer rule). Node i writes ``adj[tokens[i]]`` iff no node j with the same token
comes later in the write order (non-path nodes by index, then the path root first): an [N, N]
comparison in row chunks, after which the writers have distinct tokens and store their rows
without races.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference.accept import PROB_BITS, UNIFORM_BITS
from ..sampling import truncated_probs
from ..tree import Tree
from ._common import launch, next_pow2

MAX_NODES = 1024   # the walk keeps the tree in one program (per-node vectors of BLOCK_N)
MAX_K = 64         # the top-k merge unrolls k steps per chunk


@triton.jit
def _node_topk_kernel(
    logits_ptr, probs_ptr, argmax_ptr, topk_ptr, mass_ptr,
    # sizes
    n_vocab,
    # strides
    stride_ln, stride_lv, stride_pn, stride_pv, stride_tn,
    # meta-parameters
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr, SAMPLING: tl.constexpr,
    PROB_SCALE: tl.constexpr,
):
    node = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    kk = tl.arange(0, K_PAD)
    NONE: tl.constexpr = 2147483647          # index of an empty slot: loses every tie
    best_v = tl.full([K_PAD], float("-inf"), tl.float32)
    best_i = tl.full([K_PAD], NONE, tl.int32)
    mass = tl.zeros([BLOCK_V], tl.int64)
    for start in range(0, n_vocab, BLOCK_V):
        idx = start + offs
        live = idx < n_vocab
        x = tl.load(logits_ptr + node * stride_ln + idx * stride_lv, mask=live, other=float("-inf"))
        if SAMPLING:
            p = tl.load(probs_ptr + node * stride_pn + idx * stride_pv, mask=live, other=0.0)
            mass += (p * PROB_SCALE).to(tl.int64)
        # Later chunks hold larger indices, so an element equal to the k-th best loses its tie:
        # a chunk can enter the top-k only if its max beats the k-th value, or a slot is empty.
        kth_v = tl.min(tl.where(kk < K, best_v, float("inf")), axis=0)
        kth_i = tl.max(tl.where(kk < K, best_i, 0), axis=0)
        if (tl.max(tl.where(live, x, float("-inf")), axis=0) > kth_v) | (kth_i == NONE):
            # Merge: K extractions of the best of (chunk, current top-k), marking what was taken.
            alive_x = live
            alive_b = kk < K
            new_v = tl.full([K_PAD], float("-inf"), tl.float32)
            new_i = tl.full([K_PAD], NONE, tl.int32)
            for j in tl.static_range(K):
                mx = tl.max(tl.where(alive_x, x, float("-inf")), axis=0)
                ix = tl.min(tl.where(alive_x & (x == mx), idx, NONE), axis=0)
                mb = tl.max(tl.where(alive_b, best_v, float("-inf")), axis=0)
                ib = tl.min(tl.where(alive_b & (best_v == mb), best_i, NONE), axis=0)
                take_x = (mx > mb) | ((mx == mb) & (ix < ib))
                take_b = (mb > mx) | ((mx == mb) & (ib <= ix))     # the complement (no NaN logits)
                new_v = tl.where(kk == j, tl.where(take_x, mx, mb), new_v)
                new_i = tl.where(kk == j, tl.where(take_x, ix, ib), new_i)
                # (tl.where, not `&`, to mix a scalar into a vector: the interpreter's `&` can't broadcast)
                alive_x = alive_x & (tl.where(take_x, idx != ix, True))
                alive_b = alive_b & (tl.where(take_b, best_i != ib, True))
            best_v = new_v
            best_i = new_i
    tl.store(argmax_ptr + node, tl.max(tl.where(kk == 0, best_i, -1), axis=0).to(tl.int64))
    tl.store(topk_ptr + node * stride_tn + kk, best_i, mask=kk < K)
    if SAMPLING:
        tl.store(mass_ptr + node, tl.sum(mass, axis=0))


@triton.jit
def _next_on_path(u, offs, valid, tok, par, u_q, argmax_ptr, mass_ptr, probs_ptr, stride_pn, stride_pv,
                  BLOCK_N: tl.constexpr, SAMPLING: tl.constexpr, PROB_SCALE: tl.constexpr,
                  UNIFORM_ONE: tl.constexpr):
    """(accepted child of node u or -1, mask of u's children, their quantized probabilities at u)."""
    kids = valid & (par == u)
    if SAMPLING:
        p = tl.load(probs_ptr + u.to(tl.int64) * stride_pn + tok * stride_pv, mask=kids, other=0.0)
        q = (p * PROB_SCALE).to(tl.int64)
        # Residual mass when child i is tried: u's mass minus its earlier (rejected) siblings'.
        left = tl.load(mass_ptr + u) - (tl.cumsum(q, axis=0) - q)
        hit = kids & (u_q * left < q * UNIFORM_ONE)
        first = tl.min(tl.where(hit, offs, BLOCK_N), axis=0)
        nxt = tl.where(first < BLOCK_N, first, -1)
    else:
        q = tl.zeros([BLOCK_N], tl.int64)
        best = tl.load(argmax_ptr + u)
        nxt = tl.max(tl.where(kids & (tok == best), offs, -1), axis=0)   # siblings' tokens are distinct
    return nxt, kids, q


@triton.jit
def _walk_kernel(
    tokens_ptr, parents_ptr, depth_ptr, argmax_ptr, topk_ptr, mass_ptr, probs_ptr, uniforms_ptr, adj_ptr,
    path_ptr, n_path_ptr, bonus_ptr,
    # sizes
    n_nodes, n_vocab,
    # strides
    stride_pn, stride_pv, stride_tn, stride_adj_v, stride_adj_k,
    # meta-parameters
    BLOCK_N: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr, CHUNK_I: tl.constexpr,
    SAMPLING: tl.constexpr, PROB_SCALE: tl.constexpr, UNIFORM_ONE: tl.constexpr, UPDATE_M: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_N)
    valid = offs < n_nodes
    tok = tl.load(tokens_ptr + offs, mask=valid, other=-1)
    par = tl.load(parents_ptr + offs, mask=valid, other=-2)   # -2: padding is nobody's child
    if SAMPLING:
        u_q = (tl.load(uniforms_ptr + offs, mask=valid, other=0.0) * UNIFORM_ONE).to(tl.int64)
        u_q = tl.minimum(tl.maximum(u_q, 0), UNIFORM_ONE - 1)
    else:
        u_q = tl.zeros([BLOCK_N], tl.int64)

    # ---- the walk: one iteration per accepted node (depth + 1 <= N), no host round trip
    last = tl.full([], 0, tl.int32)
    depth = tl.full([], 0, tl.int32)
    path = tl.where(offs == 0, 0, -1).to(tl.int64)
    on_path = offs == 0
    nxt, kids, q_kids = _next_on_path(last, offs, valid, tok, par, u_q, argmax_ptr, mass_ptr, probs_ptr,
                                      stride_pn, stride_pv, BLOCK_N, SAMPLING, PROB_SCALE, UNIFORM_ONE)
    while nxt >= 0:
        last = nxt
        depth += 1
        path = tl.where(offs == depth, last.to(tl.int64), path)
        on_path = on_path | (offs == last)
        nxt, kids, q_kids = _next_on_path(last, offs, valid, tok, par, u_q, argmax_ptr, mass_ptr, probs_ptr,
                                          stride_pn, stride_pv, BLOCK_N, SAMPLING, PROB_SCALE, UNIFORM_ONE)
    tl.store(path_ptr + offs, path, mask=valid)
    tl.store(n_path_ptr, (depth + 1).to(tl.int64))

    # ---- the bonus token at the last accepted node
    if SAMPLING:
        # Inverse CDF of r = q[last] with last's children (all rejected) zeroed, R = sum(r):
        # the first x with cumsum(r)[x] * 2**24 > U[0] * R. Pass 1 finds the crossing chunk from
        # chunk sums (a child's q is subtracted from its chunk), pass 2 resolves it per token.
        kid_tok = tl.where(kids, tok, -1)
        row = probs_ptr + last.to(tl.int64) * stride_pn
        total = tl.load(mass_ptr + last) - tl.sum(q_kids, axis=0)
        threshold = tl.sum(tl.where(offs == 0, u_q, 0), axis=0) * total
        carry = tl.zeros([], tl.int64)
        hit_start = tl.full([], -1, tl.int32)
        hit_carry = tl.zeros([], tl.int64)
        for start in range(0, n_vocab, BLOCK_V):
            p = tl.load(row + (start + tl.arange(0, BLOCK_V)) * stride_pv,
                        mask=start + tl.arange(0, BLOCK_V) < n_vocab, other=0.0)
            in_chunk = (kid_tok >= start) & (kid_tok < start + BLOCK_V)
            chunk = tl.sum((p * PROB_SCALE).to(tl.int64), axis=0) - tl.sum(tl.where(in_chunk, q_kids, 0), axis=0)
            crossed = (hit_start < 0) & ((carry + chunk) * UNIFORM_ONE > threshold)
            hit_start = tl.where(crossed, start, hit_start)
            hit_carry = tl.where(crossed, carry, hit_carry)
            carry += chunk
        # Pass 2 walks the crossing chunk in BLOCK_S sub-chunks: a [BLOCK_S, BLOCK_N] token-vs-child
        # comparison zeroes the children, sized to stay ~4k elements whatever N is.
        sub = tl.arange(0, BLOCK_S)
        found = tl.full([], 2147483647, tl.int32)
        for s in range(0, BLOCK_V, BLOCK_S):
            idx = hit_start + s + sub
            live = tl.where(hit_start >= 0, idx < n_vocab, False)
            p = tl.load(row + idx * stride_pv, mask=live, other=0.0)
            is_kid = tl.max(((idx[:, None] == kid_tok[None, :]) & kids[None, :]).to(tl.int32), axis=1) > 0
            r = tl.where(is_kid, 0, (p * PROB_SCALE).to(tl.int64))
            over = live & ((hit_carry + tl.cumsum(r, axis=0)) * UNIFORM_ONE > threshold)
            found = tl.minimum(found, tl.min(tl.where(over, idx, 2147483647), axis=0))
            hit_carry += tl.sum(r, axis=0)
        # unreachable while R > 0 (U[0] < 2**24); the reference's argmax of all-False gives 0 too
        found = tl.where(found == 2147483647, 0, found)
        tl.store(bonus_ptr, found.to(tl.int64))
    else:
        tl.store(bonus_ptr, tl.load(argmax_ptr + last))

    # ---- M update: node i writes iff no node with the same token comes later in the write order
    # (key = index, + N on the path). Rows i go CHUNK_I at a time against all N columns, so the
    # comparison stays ~4k elements; a row's on-path flag is read back from the stored path
    # (path[depth[i]] == i) after a barrier makes the path's stores visible to every thread.
    if UPDATE_M:
        tl.debug_barrier()
        key = tl.where(on_path, n_nodes + offs, offs)
        kk = tl.arange(0, K_PAD)
        for i0 in range(0, n_nodes, CHUNK_I):
            rows = i0 + tl.arange(0, CHUNK_I)
            live = rows < n_nodes
            tok_i = tl.load(tokens_ptr + rows, mask=live, other=-1)
            depth_i = tl.load(depth_ptr + rows, mask=live, other=0)
            key_i = tl.where(tl.load(path_ptr + depth_i, mask=live, other=-1) == rows, n_nodes + rows, rows)
            later_dup = (tok_i[:, None] == tok[None, :]) & (key[None, :] > key_i[:, None]) & valid[None, :]
            writer = live & (tok_i >= 0) & (tl.max(later_dup.to(tl.int32), axis=1) == 0)   # padding: no write
            wmask = writer[:, None] & (kk < K)[None, :]
            top = tl.load(topk_ptr + rows[:, None] * stride_tn + kk[None, :], mask=wmask, other=-1)
            tl.store(adj_ptr + tok_i[:, None] * stride_adj_v + kk[None, :] * stride_adj_k, top, mask=wmask)


def _config(n_nodes: int, n_vocab: int, k: int) -> dict:
    """Heuristic tile sizes: the vocabulary in chunks of up to 1024 (a 151k Qwen vocab = 148
    chunks; the top-k merge only runs on chunks that beat the current k-th value), the tree in
    one block, k padded to a power of two."""
    block_v, block_n = min(next_pow2(n_vocab), 1024), next_pow2(n_nodes)
    tile = max(4096 // block_n, 1)   # [rows, N] comparisons of the walk program stay ~4k elements
    return dict(BLOCK_V=block_v, BLOCK_N=block_n, K_PAD=next_pow2(k), BLOCK_S=min(tile, block_v),
                CHUNK_I=min(tile, block_n), walk_warps=4 if n_nodes <= 128 else 8)


def accept(tree: Tree, logits: Tensor, adj: Tensor | None, temperature: float, top_p: float,
           uniforms: Tensor | None = None, generator: torch.Generator | None = None
           ) -> tuple[Tensor, Tensor, Tensor]:
    """Triton version of ``graft_tk.reference.accept.accept`` (same arguments, outputs and in-place
    update of ``adj``); two launches, no host sync.

    Greedy (temperature 0) runs entirely in the two kernels. Sampling first computes every row's
    nucleus-truncated probabilities with ``graft_tk.sampling.truncated_probs`` in torch (per row,
    so the same bits as the reference's walk, which computes only the rows it visits; on a GPU all
    N rows cost microseconds), and draws ``uniforms`` when none are given. ``adj=None`` skips the M
    update. logits must be float32 (fp32 is what the target returns); N <= 1024, k <= 64.
    """
    n, vocab = logits.shape if logits.dim() == 2 else (-1, -1)
    if logits.dim() != 2 or n != tree.n or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [N={tree.n}, V], got {logits.dtype} {list(logits.shape)}")
    if tree.tokens.device != logits.device:
        raise ValueError(f"tree is on {tree.tokens.device}, logits on {logits.device}")
    update_m = adj is not None
    if not update_m:
        adj = torch.full((1, 1), -1, dtype=torch.int32, device=logits.device)   # never written
    elif adj.dim() != 2 or adj.dtype != torch.int32 or adj.shape[0] != vocab:
        raise ValueError(f"adj must be int32 [V={vocab}, k], got {adj.dtype} {list(adj.shape)}")
    k = adj.shape[1]
    if n > MAX_NODES or not 1 <= k <= min(MAX_K, vocab):
        raise ValueError(f"need N <= {MAX_NODES} and 1 <= k <= min({MAX_K}, V), got N={n}, k={k}, V={vocab}")
    device = logits.device
    sampling = temperature != 0.0
    if sampling:
        probs = truncated_probs(logits, temperature, top_p)
        if uniforms is None:
            uniforms = torch.rand(n, generator=generator, device=device)
        if uniforms.shape != (n,) or uniforms.device != device:
            raise ValueError(f"uniforms must be [N={n}] on {device}, got {list(uniforms.shape)} on {uniforms.device}")
        uniforms = uniforms.to(torch.float32).contiguous()
    else:
        probs, uniforms = logits, logits   # unused: the SAMPLING=False specialisation never reads them
    cfg = _config(n, vocab, k)
    meta = dict(SAMPLING=sampling, PROB_SCALE=float(2 ** PROB_BITS))

    argmax = torch.empty(n, dtype=torch.int64, device=device)
    topk = torch.empty(n, k, dtype=torch.int32, device=device)
    mass = torch.empty(n, dtype=torch.int64, device=device)
    launch(_node_topk_kernel, (n,), logits, probs, argmax, topk, mass,
           vocab,
           logits.stride(0), logits.stride(1), probs.stride(0), probs.stride(1), topk.stride(0),
           K=k, K_PAD=cfg["K_PAD"], BLOCK_V=cfg["BLOCK_V"], **meta)

    path = torch.empty(n, dtype=torch.int64, device=device)
    n_path = torch.empty((), dtype=torch.int64, device=device)
    bonus = torch.empty((), dtype=torch.int64, device=device)
    launch(_walk_kernel, (1,), tree.tokens, tree.parents, tree.depth, argmax, topk, mass, probs, uniforms, adj,
           path, n_path, bonus,
           n, vocab,
           probs.stride(0), probs.stride(1), topk.stride(0), adj.stride(0), adj.stride(1),
           BLOCK_N=cfg["BLOCK_N"], K=k, K_PAD=cfg["K_PAD"], BLOCK_V=cfg["BLOCK_V"],
           BLOCK_S=cfg["BLOCK_S"], CHUNK_I=cfg["CHUNK_I"],
           UNIFORM_ONE=2 ** UNIFORM_BITS, UPDATE_M=update_m, num_warps=cfg["walk_warps"], **meta)
    return path, n_path, bonus
