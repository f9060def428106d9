"""KV commit in torch: after verification, the accepted path's KV becomes a contiguous continuation.

The tree block's KV sits in slots [prefix_len, prefix_len + N) in node order; the accepted path
(root first) is scattered over it. Worked example, prefix_len t = 7, accepted path nodes [0, 2, 3]::

    src_slots = [7, 9, 10]  ->  slots [7, 8, 9]      (dst_start = 7)

Source and destination overlap (slot 9 is read for row 1 and written by row 2), so every row
must be read before any row is written: here the gather on the right-hand side makes a copy
first.
"""
from __future__ import annotations

import torch
from torch import Tensor


def commit_kv(kv: Tensor, src_slots: Tensor, dst_start: int | Tensor) -> None:
    """Copy slot ``src_slots[i]`` to slot ``dst_start + i`` for every layer, K and V, in place.

    Parameters
    ----------
    kv : Tensor, any dtype [L, 2, B, H, S, D]
        The static KV cache (layer, K/V, batch, kv-head, slot, head dim).
    src_slots : Tensor, int64 [n]
        Source slots, in [0, S); may overlap [dst_start, dst_start + n).
    dst_start : int, or int64 0-d Tensor on kv's device
        First destination slot; ``dst_start + n <= S``. A tensor keeps the host from knowing it
        (a step captured in a CUDA graph replays with a new one).
    """
    n = src_slots.shape[0]
    if n == 0:
        return
    if isinstance(dst_start, Tensor):
        dst = dst_start + torch.arange(n, device=kv.device)
        kv.index_copy_(4, dst, kv.index_select(4, src_slots.long()))   # all rows read, then written
    else:
        kv[:, :, :, :, dst_start:dst_start + n] = kv[:, :, :, :, src_slots]
