"""Tree attention in Triton: flash-style online softmax over a visible prefix plus a masked block.

Same signature and semantics as ``graft_tk.reference.tree_attention`` (read its module docstring
for the one mask form that covers verification, drafting, prefill and decode).

Layout of the work: one program per (query block, kv head, batch). The program's rows are the
flattened (query head in the kv head's group, query) pairs, so a GQA group shares every K/V tile
it loads: a T = 1 decode step of Qwen2.5-1.5B (12 query heads on 2 kv heads) fills 6 rows of one
block per kv head instead of launching 12 programs that each read the same keys.

Two loops over key blocks:
  1. full prefix blocks: every key visible, so neither the mask nor bounds are loaded;
  2. the rest (the partial last prefix block, then the masked block): a key is visible when it is
     in the prefix or its mask bit is set; keys past kv_len are masked by bounds.
Masked scores are -inf; the running max is clamped to 0 while a row has seen no key, so exp2 never
computes -inf - (-inf), and a row that saw no key ends with l = 0 and stores zeros.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..autotune import select
from ..reference.tree_attention import check_tree_attention_args
from ._common import interpreted, launch, next_pow2

HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two: tl.arange needs one, tl.dot needs >= 16
_LOG2E = 1.4426950408889634          # softmax in base 2: exp(x) = exp2(x * log2(e)), one multiply folded into scale


@triton.jit
def _tree_attention_kernel(
    # pointers
    Q, K, V, Mask, Out,
    # sizes
    T, group, prefix_len, kv_len, qk_scale,
    # strides
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_mt, stride_ml,
    stride_ob, stride_oh, stride_ot, stride_od,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,     # dots on fp32 operands (the interpreter cannot multiply bf16)
    PRECISION: tl.constexpr,    # "ieee" for fp32 inputs: tf32 (10-bit mantissa) would break fp32 exactness
):
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)   # flattened (head in group, query) index
    row_ok = rows < group * T
    head = kv_head * group + rows // T
    query = rows % T
    d = tl.arange(0, HEAD_DIM)

    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qt + d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + kv_head * stride_kh + d[:, None] * stride_kd   # K^T tile: [HEAD_DIM, BLOCK_N]
    v_base = V + b * stride_vb + kv_head * stride_vh + d[None, :] * stride_vd   # V tile:   [BLOCK_N, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scaled scores (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # 1. Full prefix blocks: all keys visible and in bounds.
    full_end = (prefix_len // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + cols[None, :] * stride_ks)
        v = tl.load(v_base + cols[:, None] * stride_vs)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))             # finite: every score here is finite
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # 2. The partial last prefix block and the masked block.
    for start in range(full_end, kv_len, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_kv = cols < kv_len
        k = tl.load(k_base + cols[None, :] * stride_ks, mask=in_kv[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vs, mask=in_kv[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        mask_col = cols - prefix_len
        in_block = (mask_col >= 0) & in_kv
        bits = tl.load(Mask + query[:, None] * stride_mt + mask_col[None, :] * stride_ml,
                       mask=row_ok[:, None] & in_block[None, :], other=0)
        visible = (cols < prefix_len)[None, :] | (bits != 0)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: avoid -inf - -inf
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]    # l = 0: no visible key, acc = 0 -> zeros
    tl.store(Out + b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_ot + d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def block_sizes(rows: int, head_dim: int, dtype: torch.dtype | str = torch.bfloat16) -> dict:
    """Heuristic tile sizes for ``rows = (Hq // Hkv) * T`` flattened query rows.

    Used on CPU / under the interpreter, and on a GPU whose shape bucket has no tuned config
    (graft-autotune; candidates in ``graft_tk.autotune.tree_attention``). BLOCK_M covers
    the rows of a decode step or a tree verify (<= 64 nodes x group) in one program, 16 at least
    (tl.dot's minimum); BLOCK_N = 64 keys per tile, 32 at head_dim 256 to bound the K/V tiles'
    registers (2 x 32 x 256 fp16 = 32 KB). fp32, the exactness path, whose ``ieee`` dots run on
    FMA units with whole tiles in registers, takes 32-key tiles, at most 32 rows from head dim 128
    and 8 warps for 64 rows: its 64 x 64 tiles spill 20-50 KB per thread on sm_80 and sm_90,
    these <= 280 B (``bench/compile_check.py``).
    """
    fp32 = str(dtype).removeprefix("torch.") == "float32"
    block_m = min(max(next_pow2(rows), 16), 32 if fp32 and head_dim >= 128 else 64)
    block_n = 32 if head_dim >= 256 or fp32 else 64
    wide = block_m * head_dim > 64 * 64 or (fp32 and block_m >= 64)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8 if wide else 4, num_stages=2)


def shape_bucket(rows: int, head_dim: int, kv_len: int, dtype: torch.dtype | str) -> str:
    """The autotune cache's shape bucket: rows rounded up to a power of two in [16, 1024] (BLOCK_M <= 128
    leaves nothing to tune past that), kv_len to a power of two in [256, 65536], head dim and dtype exact.

    rows 54, head dim 128, kv_len 1000, bf16 -> "rows=64,head_dim=128,kv_len=1024,dtype=bfloat16".
    ``block_sizes`` gives the same tiles for every rows value in a bucket.
    """
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported by the Triton tree attention; supported: {HEAD_DIMS}")
    rows_b = min(max(next_pow2(rows), 16), 1024)
    kv_b = min(max(next_pow2(kv_len), 256), 65536)
    return f"rows={rows_b},head_dim={head_dim},kv_len={kv_b},dtype={str(dtype).removeprefix('torch.')}"


def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, mask: Tensor,
                   scale: float | None = None, validate: bool = True) -> Tensor:
    """Triton kernel for ``graft_tk.reference.tree_attention`` (same arguments, same result).

    q [B, Hq, T, D], k/v [B, Hkv, S, D] (any strides), prefix_len int, mask bool [T, L];
    returns q's dtype [B, Hq, T, D]; a query that sees no key outputs zeros. D must be a power of
    two from 16 to 256 (ValueError otherwise). One launch. ``validate=False`` skips the argument
    checks (a model checks them in its first layer only: the other layers have the same shapes).
    """
    prefix_len = check_tree_attention_args(q, k, v, prefix_len, mask) if validate else prefix_len
    B, Hq, T, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim {D} is not supported by the Triton tree attention; supported: {HEAD_DIMS}")
    rows = Hq // k.shape[1] * T
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    meta = block_sizes(rows, D, q.dtype)
    if not interpreted():  # on a GPU: this GPU's tuned tiles for the shape bucket, if any (graft-autotune)
        meta = select("tree_attention", shape_bucket(rows, D, prefix_len + mask.shape[1], q.dtype), meta, q.device)
    _launch(q, k, v, prefix_len, mask, scale, out, meta)
    return out


def _launch(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, mask: Tensor, scale: float, out: Tensor,
            meta: dict) -> None:
    """One launch of the kernel with tile sizes ``meta`` (checked arguments; the autotuner times this)."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    kv_len = prefix_len + mask.shape[1]
    mask_u8 = mask.view(torch.uint8)  # same bytes; a uint8 pointer is loaded the same on GPU and interpreter
    if interpreted():
        meta = {name: value for name, value in meta.items() if name not in ("num_warps", "num_stages")}
    grid = (triton.cdiv(group * T, meta["BLOCK_M"]), Hkv, B)
    launch(_tree_attention_kernel, grid,
           q, k, v, mask_u8, out,
           T, group, prefix_len, kv_len, scale * _LOG2E,
           *q.stride(), *k.stride(), *v.stride(), *mask_u8.stride(), *out.stride(),
           HEAD_DIM=D, DOT_FP32=interpreted() and q.dtype == torch.bfloat16,
           PRECISION="ieee" if q.dtype == torch.float32 else None, **meta)  # None: the target's default
