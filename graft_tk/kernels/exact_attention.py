"""Row-invariant tree attention in Triton: each query's output a function of that query and its
logical key sequence alone, whatever the width of the call or where its keys sit in the cache.

Same signature and contract as ``graft_tk.reference.tree_attention``; the torch counterpart for
CPUs is ``graft_tk.models.exact.attention`` (the module docstring there says why exact mode needs
it). ``graft_tk.kernels.tree_attention`` is not row-invariant: its program's rows are the
flattened (head, query) pairs of a query block, so a query's place in its tiles depends on the
width of the call, and its keys are tiled by slot, so a tree node's ancestors share a tile with
other nodes' keys where plain decoding's query at the same position has them in order.

Here one program per (query, kv head, batch row): its rows are the query's GQA group of heads
(padded to 16, ``tl.dot``'s minimum), the same rows whether the call verifies one query or 64.
The program walks the query's *logical* keys in tiles of ``BLOCK_N`` at fixed offsets from 0:
the cached prefix in place, then its visible block keys in mask-column order (a tree's nodes come
after their parents, so these are its ancestors by depth and itself: the slots plain decoding
would have committed them to). Logical position p reads slot p below the row's prefix and slot
prefix + cols[p - prefix] above it. A tile past the query's last key is never loaded; lanes past
it are masked to -inf, so they add exact zeros to the tile's sums. Same tiles, same lanes, same
loop: the same bits. No key splits (a split's merge would depend on how many the call has).

On a GPU this gives up the tiles a wide verify could share between queries (a 16-node verify
runs 16 programs per kv head over the same prefix); the prefill keeps the ordinary kernel (exact
mode reads every prompt in the same chunks, so its keys are the same bits anyway).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference.tree_attention import check_tree_attention_args
from ._common import interpreted, launch, next_pow2
from .tree_attention import HEAD_DIMS, tree_attention

_LOG2E = 1.4426950408889634


@triton.jit
def _exact_attention_kernel(
    Q, K, V, Prefix, Cols, Count, Out,
    group, qk_scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_cb, stride_ct, stride_cl,
    stride_nb, stride_nt,
    stride_ob, stride_oh, stride_ot, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,     # dots on fp32 operands (the interpreter cannot multiply bf16)
    PRECISION: tl.constexpr,    # "ieee" for fp32 inputs
):
    query = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    prefix_len = tl.load(Prefix + b).to(tl.int32)
    n_keys = prefix_len + tl.load(Count + b * stride_nb + query * stride_nt)    # its logical sequence's length

    g = tl.arange(0, BLOCK_M)                         # the query's heads in the kv head's group
    row_ok = g < group
    head = kv_head * group + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + query * stride_qt + d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + kv_head.to(tl.int64) * stride_kh + d[:, None] * stride_kd
    v_base = V + b * stride_vb + kv_head.to(tl.int64) * stride_vh + d[None, :] * stride_vd
    cols_base = Cols + b * stride_cb + query * stride_ct

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(0, n_keys, BLOCK_N):           # every tile holds at least one of its keys
        pos = start + tl.arange(0, BLOCK_N)           # logical positions
        valid = pos < n_keys
        above = pos >= prefix_len
        col = tl.load(cols_base + (pos - prefix_len) * stride_cl, mask=valid & above, other=0)
        slot = tl.where(above, prefix_len + col, pos)
        k = tl.load(k_base + slot[None, :] * stride_ks, mask=valid[None, :], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs, mask=valid[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))         # finite: the tile has a key
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]    # no key: zeros
    tl.store(Out + b * stride_ob + head[:, None] * stride_oh + query * stride_ot + d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def block_sizes(group: int, head_dim: int, dtype: torch.dtype) -> dict:
    """The tiles: a function of the model's shapes alone, never of the call's width (they fix the
    order of every sum). Rows: the GQA group, 16 at least; keys as ``tree_attention``'s tiles."""
    fp32 = dtype == torch.float32
    return dict(BLOCK_M=max(next_pow2(group), 16), BLOCK_N=32 if head_dim >= 256 or fp32 else 64,
                num_warps=4, num_stages=2)


def logical_columns(block: Tensor) -> tuple[Tensor, Tensor]:
    """Each query's visible block columns in order, int32 [B, T, L] (the rest padding), and how
    many, int32 [B, T]: its logical keys after the prefix."""
    cols = torch.argsort((~block).to(torch.uint8), dim=-1, stable=True)     # visible first, in column order
    return cols.to(torch.int32), block.sum(-1, dtype=torch.int32)


def exact_attention(q: Tensor, k: Tensor, v: Tensor, prefix: Tensor, block: Tensor | None, keys: int,
                    scale: float | None = None, validate: bool = True) -> Tensor:
    """``graft_tk.reference.tree_attention`` (same arguments, same result to rounding) with each
    query's output bitwise what the call of that query alone gives at its logical position (see
    the module). A prompt chunk (``block`` None, T > 1) runs ``tree_attention``."""
    if validate:
        check_tree_attention_args(q, k, v, prefix, block, keys)
    B, Hq, T, D = q.shape
    if block is None and T > 1:
        return tree_attention(q, k, v, prefix, block, keys, scale, validate=False)
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim {D} is not supported by the Triton tree attention; supported: {HEAD_DIMS}")
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if block is None:                     # one decoded token: its own key after the prefix
        block = torch.ones(B, 1, 1, dtype=torch.bool, device=q.device)
    cols, count = logical_columns(block)
    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    meta = block_sizes(group, D, q.dtype)
    if interpreted():
        meta = {name: value for name, value in meta.items() if name not in ("num_warps", "num_stages")}
    launch(_exact_attention_kernel, (T, Hkv, B),
           q, k, v, prefix, cols, count, out, group, scale * _LOG2E,
           *q.stride(), *k.stride(), *v.stride(), *cols.stride(), *count.stride(), *out.stride(),
           HEAD_DIM=D, DOT_FP32=interpreted() and q.dtype == torch.bfloat16,
           PRECISION="ieee" if q.dtype == torch.float32 else None, **meta)
    return out
