"""Tree attention: queries attend to a visible prefix of the KV cache plus a masked block, per row.

One form covers every attention of a decode step (``graft_tk.models.attention.AttentionPlan``):
in batch row b, keys ``[0, prefix[b])`` are visible to all queries, then ``block[b]`` [T, L] says
which of the next L keys each query sees (None: causal over the T new keys)::

    tree verification     prefix = committed KV            block = the tree's ancestor mask [N, N]
    drafter frontier      prefix = committed KV + root     block = rows over the scratch slots
    causal prefill        prefix = start                   block = None (lower-triangular, never built)
    T = 1 decode          prefix = start                   block = [[True]]

Worked example: prefix = [7] and the 6-node tree of ``graft_tk.tree``: query 3 (node c) sees
keys 0..6 (the prefix) and keys 7 + {0, 1, 3} (root, a, c); 10 keys of the 13-key window.

A query row that sees no key at all (prefix 0 and an all-False block row) outputs zeros (SDPA
would give NaN): such rows are padding, and zeros keep them from poisoning later layers.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_SCORES_PER_CHUNK = 1 << 24   # fp32 attention scores held at once (64 MB)


def check_tree_attention_args(q: Tensor, k: Tensor, v: Tensor, prefix: Tensor, block: Tensor | None,
                              keys: int) -> None:
    """Validate shapes, dtypes and devices (no device value is read). Raises ValueError."""
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
    if not isinstance(prefix, Tensor) or prefix.shape != (B,) or prefix.dtype != torch.int64:
        raise ValueError(f"prefix must be an int64 tensor [B={B}] (each row's visible cached keys); got "
                         f"{getattr(prefix, 'dtype', type(prefix).__name__)} {list(getattr(prefix, 'shape', []))}")
    if block is not None and (block.dtype != torch.bool or block.dim() != 3 or block.shape[:2] != (B, T)):
        raise ValueError(f"block must be bool [B={B}, T={T}, L] or None (causal); got {block.dtype} "
                         f"{list(block.shape)}")
    L = T if block is None else block.shape[2]
    if not L <= keys <= S:
        raise ValueError(f"keys ({keys}) must cover the block's {L} columns and fit the {S} cached keys")
    devices = {q.device, k.device, v.device, prefix.device} | ({block.device} if block is not None else set())
    if len(devices) > 1:
        raise ValueError(f"q, k, v, prefix, block must be on one device; got {', '.join(map(str, devices))}")


def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix: Tensor, block: Tensor | None, keys: int,
                   scale: float | None = None, validate: bool = True) -> Tensor:
    """Attention of T queries per row over a visible prefix plus a masked block of the KV cache.

    Parameters
    ----------
    q : Tensor, float32/float16/bfloat16 [B, Hq, T, D]
        Queries. Query head h reads kv head ``h // (Hq // Hkv)`` (grouped-query attention).
    k, v : Tensor, same dtype as q, [B, Hkv, S, D]
        Keys and values, e.g. the static cache.
    prefix : Tensor, int64 [B]
        Keys ``[0, prefix[b])`` are visible to every query of row b.
    block : Tensor, bool [B, T, L], or None
        Key ``prefix[b] + j`` is visible to query i of row b iff ``block[b, i, j]``. None = causal
        over the T new keys (L = T, query i sees keys up to ``prefix[b] + i``): a prefill,
        without a T x T mask.
    keys : int
        A host bound: ``prefix[b] + L <= keys`` for every row; keys past it are never read
        (the caller guarantees the bound: checking it would read the device).
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
    if validate:
        check_tree_attention_args(q, k, v, prefix, block, keys)
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    L = T if block is None else block.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if block is None and keys == T:
        # A prefill from slot 0 (a plan's keys cover its prefix, so every prefix is 0): plain causal
        # attention, torch's fused kernel (a 2k-token prompt of the 1.5B Qwen: 0.1 s a layer,
        # against 0.5 s for the masked form below on a 2-core Zen 4).
        return F.scaled_dot_product_attention(q, k[:, :, :T], v[:, :, :T], is_causal=True, scale=scale,
                                              enable_gqa=True)     # a constant: heads may be symbolic when compiled
    rel = torch.arange(keys, device=q.device) - prefix[:, None]          # [B, keys]: key - prefix
    if block is None:
        # A prefill chunk after cached keys: torch's fused kernel with the causal mask shifted
        # by each row's prefix ([B, 1, T, keys] bools; never [T, keys] floats per head).
        seen = rel[:, None, None, :] <= torch.arange(T, device=q.device)[None, None, :, None]
        return F.scaled_dot_product_attention(q, k[:, :, :keys], v[:, :, :keys], attn_mask=seen, scale=scale,
                                              enable_gqa=True)

    def visible(t0: int, t1: int) -> Tensor:                             # [B, t1 - t0, keys] bool
        rows = torch.arange(t0, t1, device=q.device)[None, :, None]
        if block is None:
            return rel[:, None, :] <= rows
        in_block = (rel >= 0) & (rel < L)
        bits = block[:, t0:t1].gather(2, rel.clamp(0, max(L - 1, 0))[:, None, :].expand(-1, t1 - t0, -1))
        return (rel < 0)[:, None, :] | (in_block[:, None, :] & bits)

    keys_f, values = k[:, :, :keys].float(), v[:, :, :keys].float()     # [B, Hkv, keys, D], no GQA copy
    # Query head h = kv_head * group + g reads kv head h // group: the group's heads become rows of
    # one matmul per kv head. Queries go in chunks so that a long prefill's scores stay ~64 MB.
    qg = q.float().view(B, Hkv, group, T, D)

    def attend(t0: int, t1: int) -> Tensor:                              # queries [t0, t1)
        rows = qg[:, :, :, t0:t1].reshape(B, Hkv, group * (t1 - t0), D)
        scores = (rows @ keys_f.transpose(-1, -2)).view(B, Hkv, group, t1 - t0, keys) * scale
        seen = visible(t0, t1)[:, None, None]                            # [B, 1, 1, t, keys]
        scores = scores.masked_fill(~seen, float("-inf"))
        probs = torch.softmax(scores, dim=-1)                             # NaN on rows with no key
        out = (probs.view(B, Hkv, group * (t1 - t0), keys) @ values).view(B, Hkv, group, t1 - t0, D)
        return torch.where(seen.any(-1)[..., None], out, torch.zeros((), device=out.device))

    chunk = max(1, _SCORES_PER_CHUNK // max(B * Hq * keys, 1))
    if T <= chunk:      # a decode step: one chunk (and, compiled, no loop over a symbolic T)
        out = attend(0, T)
    else:
        out = torch.cat([attend(t0, min(T, t0 + chunk)) for t0 in range(0, T, chunk)], dim=3)
    return out.reshape(B, Hq, T, D).to(q.dtype)
