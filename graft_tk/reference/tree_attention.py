"""Tree attention: queries attend to a shared prefix of the KV cache plus a masked block.

One form covers every attention of a decode step (``prefix_len`` keys visible to all queries,
then ``mask`` over the next ``L`` keys):

    tree verification     prefix = committed KV            mask = the tree's ancestor mask [N, N]
    drafter frontier      prefix = committed KV + root     mask = rows over the scratch slots
    causal prefill        prefix = start                   mask = None (lower-triangular [T, T], never built)
    T = 1 decode          prefix = start                   mask = [[True]]

Worked example: prefix_len = 7 and the 6-node tree of ``graft_tk.tree``: query 3 (node c) sees
keys 0..6 (the prefix) and keys 7 + {0, 1, 3} (root, a, c); 10 keys of the 13-key window.

A query row that sees no key at all (prefix_len = 0 and an all-False mask row) outputs zeros
(SDPA would give NaN): such rows are padding, and zeros keep them from poisoning later layers.
"""
from __future__ import annotations

import math
import operator

import torch
from torch import Tensor

_SCORES_PER_CHUNK = 1 << 24   # fp32 attention scores held at once (64 MB)


def check_tree_attention_args(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, mask: Tensor | None) -> int:
    """Validate shapes, dtypes and devices; return ``prefix_len`` as an int. Raises ValueError."""
    prefix_len = operator.index(prefix_len)  # a Python int: a tensor here would mean a host sync
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-d [B, H, T|S, D]; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    B, Hq, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k and v must both be [B={B}, Hkv, S, D={D}]; got {list(k.shape)} and {list(v.shape)}")
    Hkv, S = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q, k, v must share one dtype of float32/float16/bfloat16; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != T):
        raise ValueError(f"mask must be bool [T={T}, L] or None (causal); got {mask.dtype} {list(mask.shape)}")
    L = T if mask is None else mask.shape[1]
    if not 0 <= prefix_len <= S - L:
        raise ValueError(f"prefix_len ({prefix_len}) + mask columns ({L}) must fit the {S} cached keys, "
                         "with prefix_len >= 0")
    devices = {q.device, k.device, v.device} | ({mask.device} if mask is not None else set())
    if len(devices) > 1:
        raise ValueError(f"q, k, v, mask must be on one device; got {', '.join(map(str, devices))}")
    return prefix_len


def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, mask: Tensor | None,
                   scale: float | None = None, validate: bool = True) -> Tensor:
    """Attention of T queries over a visible prefix plus a masked block of the KV cache.

    Parameters
    ----------
    q : Tensor, float32/float16/bfloat16 [B, Hq, T, D]
        Queries. Query head h reads kv head ``h // (Hq // Hkv)`` (grouped-query attention).
    k, v : Tensor, same dtype as q, [B, Hkv, S, D]
        Keys and values, e.g. the static cache; only the first ``kv_len = prefix_len + L`` are read.
    prefix_len : int
        Keys ``[0, prefix_len)`` are visible to every query.
    mask : Tensor, bool [T, L], or None
        Key ``prefix_len + j`` is visible to query i iff ``mask[i, j]``. None = causal over the T
        new keys (L = T, query i sees keys up to ``prefix_len + i``): a prefill, without a T x T mask.
    scale : float, optional
        Softmax scale; default ``1 / sqrt(D)``.
    validate : bool
        Check the arguments (ValueError); a model checks them in its first layer only.

    Returns
    -------
    Tensor, q's dtype, [B, Hq, T, D]
        softmax(q k^T * scale over visible keys) v, accumulated in float32; zeros for a query
        that sees no key.
    """
    prefix_len = check_tree_attention_args(q, k, v, prefix_len, mask) if validate else prefix_len
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    kv_len = prefix_len + (T if mask is None else mask.shape[1])
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cols = torch.arange(kv_len, device=q.device)

    def visible(t0: int, t1: int) -> Tensor:                             # [t1 - t0, kv_len] bool
        if mask is None:
            return cols <= prefix_len + torch.arange(t0, t1, device=q.device)[:, None]
        return torch.cat([torch.ones(t1 - t0, prefix_len, dtype=torch.bool, device=q.device), mask[t0:t1]], dim=1)

    keys, values = k[:, :, :kv_len].float(), v[:, :, :kv_len].float()   # [B, Hkv, kv_len, D], no GQA copy
    # Query head h = kv_head * group + g reads kv head h // group: the group's heads become rows of
    # one matmul per kv head. Queries go in chunks so that a long prefill's scores stay ~64 MB.
    qg = q.float().view(B, Hkv, group, T, D)

    def attend(t0: int, t1: int) -> Tensor:                              # queries [t0, t1)
        rows = qg[:, :, :, t0:t1].reshape(B, Hkv, group * (t1 - t0), D)
        scores = (rows @ keys.transpose(-1, -2)).view(B, Hkv, group, t1 - t0, kv_len) * scale
        seen = visible(t0, t1)
        scores = scores.masked_fill(~seen, float("-inf"))
        probs = torch.softmax(scores, dim=-1)                             # NaN on rows with no key
        out = (probs.view(B, Hkv, group * (t1 - t0), kv_len) @ values).view(B, Hkv, group, t1 - t0, D)
        return torch.where(seen.any(-1)[:, None], out, torch.zeros((), device=out.device))

    chunk = max(1, _SCORES_PER_CHUNK // max(Hq * kv_len, 1))
    if T <= chunk:      # a decode step: one chunk (and, compiled, no loop over a symbolic T)
        out = attend(0, T)
    else:
        out = torch.cat([attend(t0, min(T, t0 + chunk)) for t0 in range(0, T, chunk)], dim=3)
    return out.reshape(B, Hq, T, D).to(q.dtype)
