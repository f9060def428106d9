"""KV commit in torch: after verification, each row's accepted path becomes a contiguous continuation.

A row's tree block sits in slots [prefix_len, prefix_len + N) in node order; its accepted path
(root first) is scattered over it. Worked example, prefix_len t = 7, accepted path nodes [0, 2, 3]::

    src_slots = [7, 9, 10]  ->  slots [7, 8, 9]      (dst = 7)

Source and destination overlap (slot 9 is read for entry 1 and written by entry 2), so every entry
must be read before any is written: here the gather on the right-hand side makes a copy first.
Rows move independently; a row with fewer entries to move pads with ``src = dst + i`` (a slot
onto itself: no change).
"""
from __future__ import annotations

import torch
from torch import Tensor


def commit_kv(kv: Tensor, src_slots: Tensor, dst: Tensor) -> None:
    """Copy slot ``src_slots[b, i]`` to slot ``dst[b] + i`` of every row b, every layer, K and V, in place.

    Parameters
    ----------
    kv : Tensor, any dtype [L, 2, B, H, S, D]
        The static KV cache (layer, K/V, batch, kv-head, slot, head dim).
    src_slots : Tensor, int64 [B, n]
        Source slots, in [0, S); may overlap [dst[b], dst[b] + n).
    dst : Tensor, int64 [B]
        First destination slot of each row; ``dst + n <= S``. A device tensor: the host need not
        know it (a step captured in a CUDA graph replays with new ones).
    """
    B, n = src_slots.shape
    if n == 0:
        return
    rows = torch.arange(B, device=kv.device)[:, None]
    moved = kv[:, :, rows, :, src_slots.long()]                          # [B, n, L, 2, H, D]: all read first
    kv[:, :, rows, :, dst.long()[:, None] + torch.arange(n, device=kv.device)] = moved
