"""KV commit: move every row's accepted path's KV into contiguous slots, every layer, K and V, ONE launch.

Semantics are those of ``graft_tk.reference.commit_kv.commit_kv``: slot ``dst[b] + i`` of batch
row b receives its slot ``src_slots[b, i]``. Source and destination ranges overlap (accepted tree nodes sit
just after the prefix: src [t, t+2, t+3] -> dst [t, t+1, t+2] reads slot t+2 for row 1 and
writes it for row 2), so the order of reads and writes matters.

Why it is race-free on a GPU:
  * Ownership. Program (r, j) owns the [n, BLOCK_D] tile of columns j*BLOCK_D.. of one
    (layer, K/V, batch, head) row r, for ALL n source and ALL n destination slots. Every address
    it reads or writes lies in that tile's columns of that row, and no other program touches them,
    so programs never race with each other whatever order the hardware runs them in.
  * Within a program, all n source rows are loaded into registers first, then a barrier
    (``tl.debug_barrier``, i.e. ``__syncthreads``: all loads of the CTA are performed before any
    thread passes it), then all n rows are stored. Without the barrier a warp that finished its
    loads could overwrite slot t+2 while another warp of the same program has not read it yet.
  * The whole tile must therefore fit one program: BLOCK_N = next_pow2(n) rows, with BLOCK_D
    shrunk so the tile stays <= 4096 elements (n is the accepted path length, ~2-10).

The copy moves bits: the cache is viewed as the signed integer type of the same width, so fp32,
fp16, bf16 and fp8 caches take the same path and the copy is exact (the interpreter has no bf16).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import launch, next_pow2

MAX_SLOTS = 4096  # rows one program can hold; a path is a handful of tokens
_BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _commit_kv_kernel(
    kv_ptr, src_ptr, dst_ptr,
    # sizes
    n_slots, n_heads, batch, head_dim,
    # strides of kv [L, 2, B, H, S, D]
    stride_l, stride_c, stride_b, stride_h, stride_s, stride_d,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)   # (layer, k/v, batch, head) flattened; int64: big caches
    h = row % n_heads
    b = (row // n_heads) % batch
    c = (row // (n_heads * batch)) % 2
    layer = row // (n_heads * batch * 2)
    base = kv_ptr + layer * stride_l + c * stride_c + b * stride_b + h * stride_h

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (offs_n < n_slots)[:, None] & (offs_d < head_dim)[None, :]
    src = tl.load(src_ptr + b * n_slots + offs_n, mask=offs_n < n_slots, other=0)
    tile = tl.load(base + src[:, None] * stride_s + offs_d[None, :] * stride_d, mask=mask)
    # Every read of this program's tile happens before any write (see the module docstring).
    tl.debug_barrier()
    dst = tl.load(dst_ptr + b).to(tl.int64) + offs_n.to(tl.int64)   # the row's first destination: a device value
    tl.store(base + dst[:, None] * stride_s + offs_d[None, :] * stride_d, tile, mask=mask)


def _config(n_slots: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_D, num_warps): all n rows in one tile of <= 4096 elements."""
    block_n = next_pow2(n_slots)
    block_d = min(next_pow2(head_dim), max(4096 // block_n, 1))
    return block_n, block_d, 1 if block_n * block_d <= 512 else 4


def commit_kv(kv: Tensor, src_slots: Tensor, dst: Tensor) -> None:
    """Copy slot ``src_slots[b, i]`` to slot ``dst[b] + i`` of every row b, every layer, K and V, in place.

    Parameters
    ----------
    kv : Tensor, [L, 2, B, H, S, D], any dtype of 1, 2, 4 or 8 bytes, any strides
        The static KV cache; updated in place.
    src_slots : Tensor, integer [B, n], n <= 4096
        Source slots in [0, S) (not checked: that would sync); may overlap the destination.
    dst : Tensor, integer [B] on kv's device
        Each row's first destination slot; ``dst[b] + n <= S`` (not checked: that would sync).
        Read by the kernel, so a step captured in a CUDA graph replays with new ones.

    One launch of L * 2 * B * H * ceil(D / BLOCK_D) programs; n = 0 launches nothing.
    """
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [L, 2, B, H, S, D], got {list(kv.shape)}")
    n_layers, _, batch, n_heads, n_cache, head_dim = kv.shape
    if (src_slots.dim() != 2 or src_slots.shape[0] != batch or src_slots.dtype.is_floating_point
            or src_slots.dtype == torch.bool):
        raise ValueError(f"src_slots must be an integer tensor [B={batch}, n], got {src_slots.dtype} "
                         f"{list(src_slots.shape)}")
    if dst.shape != (batch,) or dst.dtype.is_floating_point or dst.dtype == torch.bool:
        raise ValueError(f"dst must be an integer tensor [B={batch}], got {dst.dtype} {list(dst.shape)}")
    if src_slots.device != kv.device or dst.device != kv.device:
        raise ValueError(f"src_slots ({src_slots.device}) and dst ({dst.device}) must be on kv's device ({kv.device})")
    n = src_slots.shape[1]
    if n > MAX_SLOTS:
        raise ValueError(f"commit_kv moves at most {MAX_SLOTS} slots per call (one program holds them all), got {n}")
    if kv.element_size() not in _BITS_DTYPE:
        raise ValueError(f"kv dtype {kv.dtype} has {kv.element_size()}-byte elements; need 1, 2, 4 or 8")
    if n == 0 or kv.numel() == 0:
        return
    bits = kv.view(_BITS_DTYPE[kv.element_size()])   # same storage: writes land in kv
    src = src_slots.to(torch.int64).contiguous()
    block_n, block_d, num_warps = _config(n, head_dim)
    grid = (n_layers * 2 * batch * n_heads, triton.cdiv(head_dim, block_d))
    launch(_commit_kv_kernel, grid, bits, src, dst.to(torch.int64).contiguous(), n, n_heads, batch, head_dim,
           *bits.stride(), BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps)
