"""Tree attention in Triton: flash-style online softmax over a visible prefix plus a masked block.

Same signature and semantics as ``graft_tk.reference.tree_attention`` (read its module docstring
for the one mask form that covers verification, drafting, prefill and decode).

Layout of the work: one program per (query block, kv head, batch, key split). The program's rows
are the flattened (query head in the kv head's group, query) pairs, so a GQA group shares every
K/V tile it loads: a T = 1 decode step of Qwen2.5-1.5B (12 query heads on 2 kv heads) fills 6
rows of one block per kv head instead of launching 12 programs that each read the same keys.

That leaves a decode step or a small tree with a handful of programs, each streaming the whole
context, on a GPU of 100+ SMs. Flash-decoding splits the keys: with ``KV_SPLITS`` = s > 1 each of
s programs per block takes a contiguous range of the keys (a multiple of BLOCK_N), stores its
normalised output and log2-sum-exp in fp32, and ``_combine_splits_kernel`` merges the s partials
of each row by their weights 2^(lse_i - max lse). One split stores the output directly.

Two loops over a program's key blocks:
  1. full prefix blocks: every key visible, so neither the mask nor bounds are loaded;
  2. the rest (the partial last prefix block, then the masked block): a key is visible when it is
     in the prefix or its mask bit is set (causal: its column <= the query's); keys past kv_len
     are masked by bounds. Causal (mask None, a prefill) stops at the block row's last query, so
     the blocks above the diagonal are never loaded.
Masked scores are -inf; the running max is clamped to 0 while a row has seen no key, so exp2 never
computes -inf - (-inf), and a row that saw no key ends with l = 0 and stores zeros. The batch and
head bases are int64 scalars (b x stride_kb passes 2^31 elements in a large batched cache); the
per-row offsets stay int32, which an int64 head vector would double in registers.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..autotune import select
from ..reference.tree_attention import check_tree_attention_args
from ._common import interpreted, launch, multiprocessors, next_pow2, unused

HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two: tl.arange needs one, tl.dot needs >= 16
_LOG2E = 1.4426950408889634          # softmax in base 2: exp(x) = exp2(x * log2(e)), one multiply folded into scale


@triton.jit
def _tree_attention_kernel(
    # pointers
    Q, K, V, Prefix, Mask, Out, PartO, PartLse,
    # sizes
    T, group, L, qk_scale, n_splits, keys_per_split,
    # strides
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_mb, stride_mt, stride_ml,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_pb, stride_ph, stride_pt, stride_ps, stride_pd,   # PartO [B, Hq, T, splits, D]
    stride_lb, stride_lh, stride_lt, stride_ls,              # PartLse [B, Hq, T, splits]
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,       # no mask: key prefix_len + j is visible to query i iff j <= i
    SPLIT: tl.constexpr,        # n_splits > 1: store this split's partial output and lse for the combine
    DOT_FP32: tl.constexpr,     # dots on fp32 operands (the interpreter cannot multiply bf16)
    PRECISION: tl.constexpr,    # "ieee" for fp32 inputs: tf32 (10-bit mantissa) would break fp32 exactness
):
    pid_m = tl.program_id(0) // n_splits
    split = tl.program_id(0) % n_splits
    kv_head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)   # int64 scalar bases: b * stride_kb passes 2^31 in a large batched cache;
                                        # the per-row offsets stay int32 (registers)
    prefix_len = tl.load(Prefix + b).to(tl.int32)   # this row's visible cached keys (a device value)
    kv_len = prefix_len + L

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)   # flattened (head in group, query) index
    row_ok = rows < group * T
    head = kv_head * group + rows // T
    query = rows % T
    d = tl.arange(0, HEAD_DIM)

    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qt + d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + kv_head.to(tl.int64) * stride_kh + d[:, None] * stride_kd  # K^T tile [HEAD_DIM, BLOCK_N]
    v_base = V + b * stride_vb + kv_head.to(tl.int64) * stride_vh + d[None, :] * stride_vd  # V tile [BLOCK_N, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scaled scores (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # This program's keys: split ``split`` of [0, kv_len) (a multiple of BLOCK_N long); causal rows
    # see nothing past their last query's key, so the blocks above the diagonal are never loaded.
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, kv_len)
    if CAUSAL:
        hi = tl.minimum(hi, prefix_len + tl.max(tl.where(row_ok, query, 0), 0) + 1)
    full_end = (prefix_len // BLOCK_N) * BLOCK_N

    # 1. Full prefix blocks: all keys visible and in bounds.
    for start in range(lo, tl.minimum(hi, full_end), BLOCK_N):
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
    for start in range(tl.maximum(lo, full_end), hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_kv = cols < kv_len
        k = tl.load(k_base + cols[None, :] * stride_ks, mask=in_kv[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vs, mask=in_kv[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        mask_col = cols - prefix_len
        if CAUSAL:
            visible = (cols < prefix_len)[None, :] | ((mask_col[None, :] <= query[:, None]) & in_kv[None, :])
        else:
            in_block = (mask_col >= 0) & in_kv
            bits = tl.load(Mask + b * stride_mb + query[:, None] * stride_mt + mask_col[None, :] * stride_ml,
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
    if not SPLIT:
        tl.store(Out + b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_ot + d[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:   # this split's normalised output and log2-sum-exp, merged by _combine_splits_kernel
        part = head * stride_ph + query * stride_pt + split * stride_ps
        tl.store(PartO + b * stride_pb + part[:, None] + d[None, :] * stride_pd, out, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(PartLse + b * stride_lb + (head * stride_lh + query * stride_lt + split * stride_ls), lse,
                 mask=row_ok)


@triton.jit
def _combine_splits_kernel(PartO, PartLse, Out, n_splits, T, Hq,
                           stride_pb, stride_ph, stride_pt, stride_ps, stride_pd,
                           stride_lb, stride_lh, stride_lt, stride_ls,
                           stride_ob, stride_oh, stride_ot, stride_od,
                           HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    """One program per (b, head, query): out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max).
    A split that saw no key has lse -inf and weight 0; a row no split saw stays zeros."""
    row = tl.program_id(0)
    b = (row // (Hq * T)).to(tl.int64)
    head = (row // T) % Hq
    query = row % T
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    base = b * stride_pb + head * stride_ph + query * stride_pt
    lse = tl.load(PartLse + b * stride_lb + head * stride_lh + query * stride_lt + s * stride_ls,
                  mask=s < n_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    o = tl.load(PartO + base + s[:, None] * stride_ps + d[None, :] * stride_pd, mask=(s < n_splits)[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + b * stride_ob + head * stride_oh + query * stride_ot + d * stride_od, out.to(Out.dtype.element_ty))


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


MIN_KEYS_PER_SPLIT = 256   # a split streams at least 4 tiles of 64 keys
MAX_SPLITS = 64


def kv_splits(programs: int, kv_len: int, sms: int) -> int:
    """Heuristic number of KV splits (flash-decoding) for a launch of ``programs`` (query block, kv
    head, batch) programs over ``kv_len`` keys on a GPU with ``sms`` multiprocessors: enough splits
    to give every SM about one program, each split >= MIN_KEYS_PER_SPLIT keys; 1 when the launch
    already fills the GPU (a prefill) or ``sms`` is 0 (the interpreter).

    A T = 1 step of Qwen2.5-1.5B (2 kv heads: 2 programs) over 4,096 keys on a 132-SM H100: 16
    splits (32 programs); a 64-node verify (6 x 64 rows: 6 x 2 programs) at 32k keys: 11 splits.
    """
    if programs >= sms:
        return 1
    return max(1, min(kv_len // MIN_KEYS_PER_SPLIT, triton.cdiv(sms, programs), MAX_SPLITS))


def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix: Tensor, block: Tensor | None, keys: int,
                   scale: float | None = None, validate: bool = True) -> Tensor:
    """Triton kernel for ``graft_tk.reference.tree_attention`` (same arguments, same result).

    q [B, Hq, T, D], k/v [B, Hkv, S, D] (any strides), prefix int64 [B] (read on the device: each
    row stops at its own keys), block bool [B, T, L] or None (causal: blocks above the diagonal
    are skipped, no mask is read), keys the host's bound on any row's prefix + L (it sizes the
    key splits); returns q's dtype [B, Hq, T, D]; a query that sees no key outputs zeros. D must
    be a power of two from 16 to 256 (ValueError otherwise). One launch, two when the keys are
    split over programs (a short launch over a long context on a GPU: ``kv_splits``, or the tuned
    ``KV_SPLITS``). ``validate=False`` skips the argument checks (a model checks them in its
    first layer only: the other layers have the same shapes).
    """
    if validate:
        check_tree_attention_args(q, k, v, prefix, block, keys)
    B, Hq, T, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim {D} is not supported by the Triton tree attention; supported: {HEAD_DIMS}")
    Hkv = k.shape[1]
    rows = Hq // Hkv * T
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    meta = block_sizes(rows, D, q.dtype)
    if not interpreted():  # on a GPU: this GPU's tuned tiles for the shape bucket, if any (graft-autotune)
        meta = select("tree_attention", shape_bucket(rows, D, keys, q.dtype), meta, q.device)
    if "KV_SPLITS" not in meta:
        programs = triton.cdiv(rows, meta["BLOCK_M"]) * Hkv * B
        meta = {**meta, "KV_SPLITS": kv_splits(programs, keys, multiprocessors(q.device))}
    _launch(q, k, v, prefix, block, keys, scale, out, meta)
    return out


def _launch(q: Tensor, k: Tensor, v: Tensor, prefix: Tensor, block: Tensor | None, keys: int, scale: float,
            out: Tensor, meta: dict) -> None:
    """The kernel with tile sizes ``meta`` (checked arguments; the autotuner times this): one launch,
    or with ``KV_SPLITS`` > 1 one per split of the keys into fp32 partials, then their combine.
    The splits cover ``keys``; a row with fewer keys leaves its last splits empty (weight 0)."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    causal = block is None
    L = T if causal else block.shape[2]
    meta = dict(meta)
    block_n = meta["BLOCK_N"]
    splits = max(1, min(meta.pop("KV_SPLITS", 1), triton.cdiv(keys, block_n)))
    keys_per_split = triton.cdiv(triton.cdiv(keys, splits), block_n) * block_n
    splits = triton.cdiv(keys, keys_per_split)          # no split past the bound
    # Arguments the constexprs never read (the causal mask, one split's partials) get a cached placeholder.
    mask_u8, mask_strides = ((unused(q.device, torch.uint8), (0, 0, 0)) if causal
                             else (block.view(torch.uint8), block.stride()))
    if splits > 1:
        part_o = torch.empty(B, Hq, T, splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, Hq, T, splits, dtype=torch.float32, device=q.device)
        part_strides = (*part_o.stride(), *part_lse.stride())
    else:       # the kernel stores to ``out`` directly
        part_o = part_lse = unused(q.device, torch.float32)
        part_strides = (0,) * 9
    if interpreted():
        meta = {name: value for name, value in meta.items() if name not in ("num_warps", "num_stages")}
    grid = (triton.cdiv(group * T, meta["BLOCK_M"]) * splits, Hkv, B)
    launch(_tree_attention_kernel, grid,
           q, k, v, prefix, mask_u8, out, part_o, part_lse,
           T, group, L, scale * _LOG2E, splits, keys_per_split,
           *q.stride(), *k.stride(), *v.stride(), *mask_strides, *out.stride(), *part_strides,
           HEAD_DIM=D, CAUSAL=causal, SPLIT=splits > 1, DOT_FP32=interpreted() and q.dtype == torch.bfloat16,
           PRECISION="ieee" if q.dtype == torch.float32 else None, **meta)  # None: the target's default
    if splits > 1:
        launch(_combine_splits_kernel, (B * Hq * T,),
               part_o, part_lse, out, splits, T, Hq, *part_o.stride(), *part_lse.stride(), *out.stride(),
               HEAD_DIM=D, SPLITS=next_pow2(splits))
