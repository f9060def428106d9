"""Acceptance of every row's tree fused with the successor-matrix update: at most THREE launches.

Same signature and outputs as ``graft_tk.reference.accept.accept``; read its docstring for the
rule (a node is accepted when it is its parent's *choice*: the argmax, or the seeded draw, made in
torch before this op by ``graft_tk.sampling.choose``). The work splits where a grid-wide
dependency forces it:

1. ``_node_topk_kernel`` (only with an M update), one program per (row, node): one pass over the
   node's V logits in BLOCK_V chunks keeping a running top-k (value desc, index asc). Every node
   is independent: B x N programs in parallel.
2. ``_walk_kernel``, one program per row: walk from the root, following the child whose token is
   the current node's choice; store the path, its length and the bonus (the choice at its end).
3. ``_write_kernel`` (only with an M update), one program: every writing row's nodes write their
   top-k into M's rows, in the write order rows 0 .. B - 1, in a row non-path nodes by index then
   the path root first. Node j writes ``adj[tokens[j]]`` iff no node with the same token comes
   later in that order: an [all nodes] comparison in row chunks, after which the writers have
   distinct tokens and store their rows without races. One program, because two rows' trees may
   hold the same token.

Exactness with the reference: top-k is comparisons, no arithmetic, so the only question is ties:
both take the lowest index (``torch.topk`` on CPU orders tied values arbitrarily, so tests keep
the top-k ranks untied); the walk compares integers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import launch, next_pow2

MAX_NODES = 1024   # nodes of all rows that one M-write program compares (B x N)
MAX_K = 64         # the top-k merge unrolls k steps per chunk


@triton.jit
def _node_topk_kernel(
    logits_ptr, topk_ptr,
    # sizes
    n_vocab,
    # strides
    stride_ln, stride_lv, stride_tn,
    # meta-parameters
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    node = tl.program_id(0).to(tl.int64)     # (row, node) flattened
    offs = tl.arange(0, BLOCK_V)
    kk = tl.arange(0, K_PAD)
    NONE: tl.constexpr = 2147483647          # index of an empty slot: loses every tie
    best_v = tl.full([K_PAD], float("-inf"), tl.float32)
    best_i = tl.full([K_PAD], NONE, tl.int32)
    for start in range(0, n_vocab, BLOCK_V):
        idx = start + offs
        live = idx < n_vocab
        x = tl.load(logits_ptr + node * stride_ln + idx * stride_lv, mask=live, other=float("-inf"))
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
    tl.store(topk_ptr + node * stride_tn + kk, best_i, mask=kk < K)


@triton.jit
def _walk_kernel(
    tokens_ptr, parents_ptr, choice_ptr, path_ptr, n_path_ptr, bonus_ptr,
    n_nodes,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)    # batch row: its tree, its outputs
    offs = tl.arange(0, BLOCK_N)
    valid = offs < n_nodes
    tok = tl.load(tokens_ptr + b * n_nodes + offs, mask=valid, other=-1)
    par = tl.load(parents_ptr + b * n_nodes + offs, mask=valid, other=-2)   # -2: padding is nobody's child
    choice = tl.load(choice_ptr + b * n_nodes + offs, mask=valid, other=-1)
    # The walk: one iteration per accepted node (depth + 1 <= N); siblings' tokens are distinct,
    # so at most one child of a node is its choice.
    last = tl.full([], 0, tl.int32)
    depth = tl.full([], 0, tl.int32)
    path = tl.where(offs == 0, 0, -1).to(tl.int64)
    want = tl.sum(tl.where(offs == 0, choice, 0), axis=0)
    nxt = tl.max(tl.where(valid & (par == last) & (tok == want), offs, -1), axis=0)
    while nxt >= 0:
        last = nxt
        depth += 1
        path = tl.where(offs == depth, last.to(tl.int64), path)
        want = tl.sum(tl.where(offs == last, choice, 0), axis=0)
        nxt = tl.max(tl.where(valid & (par == last) & (tok == want), offs, -1), axis=0)
    tl.store(path_ptr + b * n_nodes + offs, path, mask=valid)
    tl.store(n_path_ptr + b, (depth + 1).to(tl.int64))
    tl.store(bonus_ptr + b, want)


@triton.jit
def _write_kernel(
    tokens_ptr, depth_ptr, path_ptr, writes_ptr, topk_ptr, adj_ptr,
    n_all, n_nodes,
    stride_tn, stride_adj_v, stride_adj_k,
    BLOCK_ALL: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, CHUNK_I: tl.constexpr,
):
    """Node j = b * N + i writes iff its row writes and no writing node with its token has a
    larger key (b, on the path, i); rows i go CHUNK_I at a time against all nodes."""
    cols = tl.arange(0, BLOCK_ALL)
    live_c = cols < n_all
    row_c = cols // n_nodes
    tok_c = tl.load(tokens_ptr + cols, mask=live_c, other=-1)
    tok_c = tl.where(tl.load(writes_ptr + row_c, mask=live_c, other=0) != 0, tok_c, -1)
    depth_c = tl.load(depth_ptr + cols, mask=live_c, other=0)
    on_c = tl.load(path_ptr + row_c * n_nodes + depth_c, mask=live_c, other=-1) == cols % n_nodes
    key_c = (row_c * 2 + on_c.to(tl.int64)) * n_nodes + cols % n_nodes
    kk = tl.arange(0, K_PAD)
    for i0 in range(0, n_all, CHUNK_I):
        rows = i0 + tl.arange(0, CHUNK_I)
        live = rows < n_all
        row_i = rows // n_nodes
        tok_i = tl.load(tokens_ptr + rows, mask=live, other=-1)
        tok_i = tl.where(tl.load(writes_ptr + row_i, mask=live, other=0) != 0, tok_i, -1)
        depth_i = tl.load(depth_ptr + rows, mask=live, other=0)
        on_i = tl.load(path_ptr + row_i * n_nodes + depth_i, mask=live, other=-1) == rows % n_nodes
        key_i = (row_i * 2 + on_i.to(tl.int64)) * n_nodes + rows % n_nodes
        later_dup = (tok_i[:, None] == tok_c[None, :]) & (key_c[None, :] > key_i[:, None]) & live_c[None, :]
        writer = live & (tok_i >= 0) & (tl.max(later_dup.to(tl.int32), axis=1) == 0)   # padding: no write
        wmask = writer[:, None] & (kk < K)[None, :]
        top = tl.load(topk_ptr + rows[:, None] * stride_tn + kk[None, :], mask=wmask, other=-1)
        tl.store(adj_ptr + tok_i[:, None] * stride_adj_v + kk[None, :] * stride_adj_k, top, mask=wmask)


def _config(n_all: int, n_vocab: int, k: int) -> dict:
    """Heuristic tile sizes: the vocabulary in chunks of up to 1024 (a 151k Qwen vocab = 148
    chunks; the top-k merge only runs on chunks that beat the current k-th value), k padded to a
    power of two, the M write's [CHUNK_I, all nodes] comparisons ~4k elements."""
    block_all = next_pow2(n_all)
    return dict(BLOCK_V=min(next_pow2(n_vocab), 1024), BLOCK_ALL=block_all, K_PAD=next_pow2(k),
                CHUNK_I=min(max(4096 // block_all, 1), block_all), write_warps=4 if n_all <= 128 else 8)


def accept(tokens: Tensor, parents: Tensor, depth: Tensor, mask: Tensor, choice: Tensor, logits: Tensor | None,
           adj: Tensor | None, writes: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Triton version of ``graft_tk.reference.accept.accept`` (same arguments, outputs and in-place
    update of ``adj``); one launch, three with an M update, whatever B; no host sync. ``mask`` is
    not read (the walk follows parents). logits float32 [B, N, V]; B x N <= 1024, k <= 64.
    """
    B, N = tokens.shape
    device = tokens.device
    if choice.shape != (B, N) or parents.shape != (B, N) or depth.shape != (B, N):
        raise ValueError(f"tokens, parents, depth and choice must all be [B={B}, N={N}]")
    path = torch.empty(B, N, dtype=torch.int64, device=device)
    n_path = torch.empty(B, dtype=torch.int64, device=device)
    bonus = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return path, n_path, bonus
    tokens, parents = tokens.contiguous(), parents.to(torch.int32).contiguous()
    launch(_walk_kernel, (B,), tokens, parents, choice.contiguous(), path, n_path, bonus, N,
           BLOCK_N=next_pow2(N), num_warps=4 if N <= 128 else 8)
    if adj is None:
        return path, n_path, bonus
    vocab = logits.shape[-1]
    if logits.shape != (B, N, vocab) or logits.dtype != torch.float32 or logits.device != device:
        raise ValueError(f"logits must be float32 [B={B}, N={N}, V] on {device}, got {logits.dtype} "
                         f"{list(logits.shape)} on {logits.device}")
    if adj.dim() != 2 or adj.dtype != torch.int32 or adj.shape[0] != vocab:
        raise ValueError(f"adj must be int32 [V={vocab}, k], got {adj.dtype} {list(adj.shape)}")
    k = adj.shape[1]
    if B * N > MAX_NODES or not 1 <= k <= min(MAX_K, vocab):
        raise ValueError(f"need B x N <= {MAX_NODES} and 1 <= k <= min({MAX_K}, V), got B={B}, N={N}, k={k}, V={vocab}")
    cfg = _config(B * N, vocab, k)
    flat = logits.reshape(B * N, vocab)
    topk = torch.empty(B * N, k, dtype=torch.int32, device=device)
    launch(_node_topk_kernel, (B * N,), flat, topk, vocab, flat.stride(0), flat.stride(1), topk.stride(0),
           K=k, K_PAD=cfg["K_PAD"], BLOCK_V=cfg["BLOCK_V"])
    writes = torch.ones(B, dtype=torch.int8, device=device) if writes is None else writes.to(torch.int8).contiguous()
    launch(_write_kernel, (1,), tokens, depth.to(torch.int32).contiguous(), path, writes, topk, adj,
           B * N, N, topk.stride(0), adj.stride(0), adj.stride(1),
           BLOCK_ALL=cfg["BLOCK_ALL"], K=k, K_PAD=cfg["K_PAD"], CHUNK_I=cfg["CHUNK_I"], num_warps=cfg["write_warps"])
    return path, n_path, bonus
