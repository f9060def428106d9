"""Weight-only quantized matmul in Triton (W4A16 / W8A16): the kernel for
``graft_tk.reference.quant_matmul`` (same arguments, same formats, documented there).

One program computes a [BLOCK_M, BLOCK_N] tile of ``x @ W.T``: it streams BLOCK_K columns of its
BLOCK_N weight rows at a time, dequantises them in registers (int4: the low and high nibbles of a
byte are the even and odd k, so they meet the even and odd columns of x in two dots and are never
interleaved; int8: one dot, the per-channel scale applied once to the fp32 accumulator) and
accumulates in fp32. Decoding has M = 1..64 rows (a token or a verified tree), so the grid is
mostly over N: the weights are read once per launch, which is what a memory-bound decode step
pays for.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import interpreted, launch, next_pow2, unused


@triton.jit
def _quant_matmul_kernel(
    X, W, Scales, Zeros, Bias, Out,
    M, N, K, GROUP,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_om, stride_on,
    INT4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,      # dots on fp32 operands (the interpreter cannot multiply bf16)
    PRECISION: tl.constexpr,     # "ieee" for fp32 inputs (tf32 would drop 13 mantissa bits)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dot_dtype = tl.float32 if DOT_FP32 else X.dtype.element_ty
    if INT4:
        half = tl.arange(0, BLOCK_K // 2)
        for k0 in range(0, K, BLOCK_K):
            byte = k0 // 2 + half                                   # [BLOCK_K / 2] bytes = BLOCK_K values
            k_even = 2 * byte
            ok = n_ok[:, None] & (k_even < K)[None, :]
            packed = tl.load(W + rn[:, None] * stride_wn + byte[None, :] * stride_wk, mask=ok, other=0)
            g = k_even // GROUP                                     # k and k + 1 share a group (GROUP even)
            s = tl.load(Scales + rn[:, None] * stride_sn + g[None, :] * stride_sg, mask=ok, other=0.0).to(tl.float32)
            z = tl.load(Zeros + rn[:, None] * stride_sn + g[None, :] * stride_sg, mask=ok, other=0.0).to(tl.float32)
            w_even = (((packed & 0x0F).to(tl.float32) - 8.0) * s + z).to(dot_dtype)     # [BLOCK_N, BLOCK_K / 2]
            w_odd = (((packed >> 4).to(tl.float32) - 8.0) * s + z).to(dot_dtype)
            x_ok = m_ok[:, None] & (k_even < K)[None, :]
            x_even = tl.load(X + rm[:, None] * stride_xm + k_even[None, :] * stride_xk, mask=x_ok, other=0.0)
            x_odd = tl.load(X + rm[:, None] * stride_xm + (k_even + 1)[None, :] * stride_xk, mask=x_ok, other=0.0)
            acc += tl.dot(x_even.to(dot_dtype), tl.trans(w_even), input_precision=PRECISION)
            acc += tl.dot(x_odd.to(dot_dtype), tl.trans(w_odd), input_precision=PRECISION)
    else:
        rk = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            w = tl.load(W + rn[:, None] * stride_wn + k[None, :] * stride_wk, mask=n_ok[:, None] & (k < K)[None, :],
                        other=0)
            x = tl.load(X + rm[:, None] * stride_xm + k[None, :] * stride_xk, mask=m_ok[:, None] & (k < K)[None, :],
                        other=0.0)
            acc += tl.dot(x.to(dot_dtype), tl.trans(w.to(dot_dtype)), input_precision=PRECISION)  # |q| <= 127: exact
        acc *= tl.load(Scales + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + rm[:, None] * stride_om + rn[None, :] * stride_on, acc.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def block_sizes(M: int, dtype: torch.dtype) -> dict:
    """Tiles for M activation rows: BLOCK_M covers a decode step's rows (16 at least, tl.dot's
    minimum; 64 at most), 64 weight rows x 64 columns per step (32 columns in fp32, whose ``ieee``
    dots hold whole tiles in registers)."""
    block_k = 32 if dtype == torch.float32 else 64
    return dict(BLOCK_M=min(max(next_pow2(M), 16), 64), BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=2)


def quant_matmul(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, group: int,
                 bias: Tensor | None = None) -> Tensor:
    """Triton kernel for ``graft_tk.reference.quant_matmul`` (same arguments, same result up to
    fp32 summation order; bf16 / fp16 weights are dequantised to x's dtype before the dot)."""
    M, K = x.shape
    N = qweight.shape[0]
    int4 = zeros is not None
    if int4 and (group % 2 or K % group or qweight.shape[1] * 2 != K):
        raise ValueError(f"int4 weight [N, K / 2] = {list(qweight.shape)} with group {group} does not match K = {K}")
    if not int4 and qweight.shape[1] != K:
        raise ValueError(f"int8 weight [N, K] = {list(qweight.shape)} does not match K = {K}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    meta = block_sizes(M, x.dtype)
    if interpreted():
        meta = {name: value for name, value in meta.items() if name not in ("num_warps", "num_stages")}
    stride_sg = scales.stride(1) if int4 else 0
    grid = (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, meta["BLOCK_M"]))
    launch(_quant_matmul_kernel, grid,
           x, qweight, scales, zeros if int4 else unused(x.device, scales.dtype),
           bias if bias is not None else unused(x.device, x.dtype), out,
           M, N, K, group, *x.stride(), *qweight.stride(), scales.stride(0), stride_sg, *out.stride(),
           INT4=int4, HAS_BIAS=bias is not None,
           DOT_FP32=interpreted() and x.dtype == torch.bfloat16,
           PRECISION="ieee" if x.dtype == torch.float32 else None, **meta)
    return out
