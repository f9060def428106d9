"""Draft expansion in Triton: log-softmax + per-row top-K + cumulative scores + global top-K (the
next frontier) + the stop flag. Same signature and tie order as
``graft_tk.reference.draft_expand.draft_expand``.

Off a GPU (and wherever the vocabulary is small) one program (grid (1,)) streams the whole [F, V]
logits tile by tile: every row at once, so each iteration is one [F_PAD, BLOCK_V] tile (4096
elements), an online log-sum-exp per row and a merge of the tile into a running top-K per row.
On a GPU that is F=16 x V=151936 fp32 = 9.7 MB through one SM, so the vocabulary is split:
stage 1 (``_draft_expand_partial_kernel``, ``vocab_chunks`` programs, about one per SM) scans a
chunk of columns of every row and stores its top-K keys, max and sum of exp; the finish (the same
kernel as the fused form, ``PARTIALS``) merges the chunks' keys and log-sum-exps instead of
streaming logits, then ranks the F*K children for the next frontier and sets the stop flag.

Ranking uses int64 keys (``_desc_key``, the reference's ``desc_key``): float32 bits mapped to an
order-preserving int in the high word, ``2**31 - 1 - index`` in the low word. Keys are unique, so
"larger value, then lower index" is a plain integer max and ties break exactly like the
reference's stable order; the winning token and its logit are both decoded from the key.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import launch, multiprocessors, next_pow2

_TILE = 4096     # logits per loop iteration: F_PAD * BLOCK_V (16 fp32 + 16 int64 per thread at 8 warps)
# Globals read inside @triton.jit must be constexpr.
_MIN_KEY = tl.constexpr(-9223372036854775808)   # below every key: "taken" / out of range
_MAX_KEY = tl.constexpr(9223372036854775807)


@triton.jit
def _desc_key(x, idx):
    """int64 key: descending key order = (x descending, idx ascending); -0.0 folded onto +0.0."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0, 0, bits)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)   # negative floats: flip magnitude bits
    return (ordered.to(tl.int64) << 32) + (2147483647 - idx.to(tl.int64))


@triton.jit
def _key_index(key):
    """The index ``_desc_key`` stored in the low word."""
    return 2147483647 - (key - ((key >> 32) << 32))


@triton.jit
def _key_value(key):
    """The float32 value ``_desc_key`` stored in the high word (-0.0 comes back as +0.0)."""
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _merge_top_k(run, key):
    """Merge a tile of keys [F_PAD, n] into the running top-K ``run`` [F_PAD, K_PAD]: while some
    row's best tile key beats its worst kept key, swap them. At most K rounds; after the first
    tiles usually 0-1, because a tile rarely holds one of the K best seen so far."""
    best = tl.max(key, 1)
    worst = tl.min(run, 1)
    while tl.max((best > worst).to(tl.int32), 0) > 0:
        take = best > worst
        run = tl.where(take[:, None] & (run == worst[:, None]), best[:, None], run)
        key = tl.where(take[:, None] & (key == best[:, None]), _MIN_KEY, key)
        best = tl.max(key, 1)
        worst = tl.min(run, 1)
    return run


@triton.jit
def _start(rows, slots, K: tl.constexpr, F_PAD: tl.constexpr):
    """An empty running top-K and log-sum-exp. The top-K starts with sentinels MIN_KEY + slot:
    distinct (so ``run == worst`` picks one slot) and below every real key (the smallest, -inf
    with index 2**31 - 1, is ~ -2**62.99); padding slots hold MAX so they are never the row
    minimum. (int64 before adding: a Python int meeting an int32 tensor is cast to int32.)"""
    sentinel = (slots[None, :] + 0 * rows[:, None]).to(tl.int64) + _MIN_KEY
    run = tl.where(slots[None, :] < K, sentinel, _MAX_KEY)                     # [F_PAD, K_PAD]
    m = tl.full([F_PAD], float("-inf"), tl.float32)                           # running max
    s = tl.zeros([F_PAD], tl.float32)                                         # sum exp(x - m)
    return run, m, s


@triton.jit
def _scan(logits_ptr, stride_f, rows, row_ok, lo, hi, run, m, s, BLOCK_V: tl.constexpr):
    """Stream logits columns [lo, hi) of every row, tile by tile, into (run, m, s)."""
    for v0 in range(lo, hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols[None, :] < hi)
        x = tl.load(logits_ptr + rows[:, None] * stride_f + cols[None, :], mask=ok,
                    other=float("-inf")).to(tl.float32)                       # [F_PAD, BLOCK_V]
        # Online log-sum-exp; m_safe avoids (-inf) - (-inf) = nan while a row has seen only -inf.
        m_new = tl.maximum(m, tl.max(x, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), 1)
        m = m_new
        run = _merge_top_k(run, tl.where(ok, _desc_key(x, cols[None, :]), _MIN_KEY))
    return run, m, s


@triton.jit
def _draft_expand_partial_kernel(
    logits_ptr, part_keys_ptr, part_m_ptr, part_s_ptr,
    F, V, stride_b, stride_f, chunk, n_chunks,
    K: tl.constexpr, F_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Stage 1 of the split path: program (c, b) scans vocabulary columns [c * chunk, (c + 1) * chunk)
    of every frontier row of batch row b and stores its top-K keys [F_PAD, K_PAD], row max and sum
    of exp for the finish."""
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    logits_ptr += b * stride_b
    part_keys_ptr += b * n_chunks * F_PAD * K_PAD
    part_m_ptr += b * n_chunks * F_PAD
    part_s_ptr += b * n_chunks * F_PAD
    rows = tl.arange(0, F_PAD)
    slots = tl.arange(0, K_PAD)
    run, m, s = _start(rows, slots, K, F_PAD)
    run, m, s = _scan(logits_ptr, stride_f, rows, rows < F, c * chunk, tl.minimum(c * chunk + chunk, V), run, m, s,
                      BLOCK_V)
    tile = c * F_PAD * K_PAD + rows[:, None] * K_PAD + slots[None, :]
    tl.store(part_keys_ptr + tile, run)
    tl.store(part_m_ptr + c * F_PAD + rows, m)
    tl.store(part_s_ptr + c * F_PAD + rows, s)


@triton.jit
def _draft_expand_kernel(
    # pointers
    frontier_ptr, logits_ptr, part_keys_ptr, part_m_ptr, part_s_ptr,
    tokens_ptr, parents_ptr, scores_ptr, next_ptr, stop_ptr, log_tau_ptr,
    # sizes, strides
    F, V, stride_b, stride_f, n_chunks,
    # meta-parameters
    K: tl.constexpr, F_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
    PARTIALS: tl.constexpr,    # merge stage 1's n_chunks partials instead of streaming the logits
):
    b = tl.program_id(0).to(tl.int64)   # batch row: its frontier, logits, partials and outputs
    frontier_ptr += b * F
    logits_ptr += b * stride_b
    part_keys_ptr += b * n_chunks * F_PAD * K_PAD
    part_m_ptr += b * n_chunks * F_PAD
    part_s_ptr += b * n_chunks * F_PAD
    tokens_ptr += b * F * K
    scores_ptr += b * F * K
    next_ptr += b * K
    log_tau = tl.load(log_tau_ptr + b)
    rows = tl.arange(0, F_PAD)
    slots = tl.arange(0, K_PAD)
    row_ok = rows < F
    run, m, s = _start(rows, slots, K, F_PAD)
    if PARTIALS:
        for c in range(0, n_chunks):
            key = tl.load(part_keys_ptr + c * F_PAD * K_PAD + rows[:, None] * K_PAD + slots[None, :])
            # a chunk's sentinels (a chunk narrower than K) and padding slots take no part
            key = tl.where((slots[None, :] < K) & (key > _MIN_KEY + K_PAD), key, _MIN_KEY)
            run = _merge_top_k(run, key)
            m_c = tl.load(part_m_ptr + c * F_PAD + rows)
            s_c = tl.load(part_s_ptr + c * F_PAD + rows)
            m_new = tl.maximum(m, m_c)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + s_c * tl.exp(m_c - m_safe)
            m = m_new
    else:
        run, m, s = _scan(logits_ptr, stride_f, rows, row_ok, 0, V, run, m, s, BLOCK_V)

    # Children in rank order. V >= K, so every sentinel was replaced by a real key.
    run = tl.sort(tl.where(slots[None, :] < K, run, _MIN_KEY), dim=1, descending=True)
    child_ok = row_ok[:, None] & (slots[None, :] < K)
    child = rows[:, None] * K + slots[None, :]                                # frontier-major index
    # ATen's log_softmax formula: (x - max) - log(sum(exp(x - max))).
    logp = (_key_value(run) - m[:, None]) - tl.log(tl.where(row_ok, s, 1.0))[:, None]   # pad rows: s = 0
    scores = tl.load(frontier_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None] + logp
    tl.store(tokens_ptr + child, _key_index(run), mask=child_ok)
    tl.store(parents_ptr + child, (rows[:, None] + 0 * slots[None, :]).to(tl.int64),
             mask=tl.where(b == 0, child_ok, False))   # every row alike: row 0 writes them
    tl.store(scores_ptr + child, scores, mask=child_ok)

    # Next frontier: the K best children, ties -> lower child index (same key trick).
    ckey = tl.where(child_ok, _desc_key(scores, child), _MIN_KEY)
    ckey = tl.sort(tl.reshape(ckey, [F_PAD * K_PAD]), dim=0, descending=True)
    pos = tl.arange(0, F_PAD * K_PAD)
    tl.store(next_ptr + pos, _key_index(ckey), mask=pos < K)
    best_score = tl.max(tl.max(tl.where(child_ok, scores, float("-inf")), 1), 0)
    tl.store(stop_ptr + b, (best_score < log_tau).to(tl.int8))


def _config(F: int, V: int, K: int) -> dict:
    """Heuristic meta-parameters (no autotuning yet). Pads are >= 2 so no tile has a size-1 dim."""
    f_pad, k_pad = max(2, next_pow2(F)), max(2, next_pow2(K))
    block_v = min(max(16, next_pow2(V)), max(16, _TILE // f_pad))
    return {"F_PAD": f_pad, "K_PAD": k_pad, "BLOCK_V": block_v, "num_warps": 8 if f_pad * block_v >= 4096 else 4}


MIN_TILES_PER_CHUNK = 4   # a stage-1 program streams at least 4 tiles


def vocab_chunks(V: int, block_v: int, sms: int) -> int:
    """Programs of stage 1 (vocabulary chunks): about one per SM, each >= MIN_TILES_PER_CHUNK tiles
    of ``block_v`` columns; 1 (the fused single launch) without a GPU. Qwen's 151,936 tokens at
    F = 16 (256-column tiles) on 132 SMs: 132 chunks; at F = 1 (2,048-column tiles): 19."""
    return max(1, min(sms, triton.cdiv(V, block_v * MIN_TILES_PER_CHUNK)))


def draft_expand(frontier_scores: torch.Tensor, logits: torch.Tensor, top_k: int, log_tau: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of ``graft_tk.reference.draft_expand.draft_expand`` (same shapes, dtypes, ties).

    frontier_scores float [B, F], logits float [B, F, V] (any float dtype, read as fp32; last dim
    contiguous), log_tau float32 [B] -> child_tokens int64 [B, F*K], child_parents int64 [F*K],
    child_scores float32 [B, F*K], next_frontier int64 [B, K], stop bool [B]. No host sync; one
    launch for every row, two on a GPU (the vocabulary over ``vocab_chunks`` programs per row,
    then the finish).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, F, V], got {list(logits.shape)}")
    B, F, V = logits.shape
    if frontier_scores.shape != (B, F):
        raise ValueError(f"frontier_scores must be [B={B}, F={F}], got {list(frontier_scores.shape)}")
    if log_tau.shape != (B,):
        raise ValueError(f"log_tau must be [B={B}], got {list(log_tau.shape)}")
    if not isinstance(top_k, int) or not 1 <= top_k <= V:
        raise ValueError(f"top_k must be an int in [1, V={V}], got {top_k!r}")
    if F < 1 or V >= 2 ** 31:
        raise ValueError(f"need F >= 1 and V < 2**31, got F={F}, V={V}")
    if not logits.is_floating_point() or frontier_scores.device != logits.device or log_tau.device != logits.device:
        raise ValueError(f"logits must be a float tensor on frontier_scores' and log_tau's device, got {logits.dtype} "
                         f"on {logits.device} (frontier_scores on {frontier_scores.device})")
    config = _config(F, V, top_k)
    return _expand(frontier_scores, logits, top_k, log_tau, config,
                   vocab_chunks(V, config["BLOCK_V"], multiprocessors(logits.device)))


def _expand(frontier_scores, logits, K: int, log_tau: torch.Tensor, config: dict, chunks: int):
    """The launches of ``draft_expand`` (checked arguments) with the vocabulary in ``chunks`` chunks."""
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    (B, F, V), dev = logits.shape, logits.device
    chunk = triton.cdiv(triton.cdiv(V, chunks), config["BLOCK_V"]) * config["BLOCK_V"]
    chunks = triton.cdiv(V, chunk)                       # no empty chunk
    child_tokens = torch.empty(B, F * K, dtype=torch.int64, device=dev)
    child_parents = torch.empty(F * K, dtype=torch.int64, device=dev)
    child_scores = torch.empty(B, F * K, dtype=torch.float32, device=dev)
    next_frontier = torch.empty(B, K, dtype=torch.int64, device=dev)
    stop = torch.empty(B, dtype=torch.int8, device=dev)
    if B == 0:
        return child_tokens, torch.arange(F, device=dev).repeat_interleave(K), child_scores, next_frontier, \
            stop.view(torch.bool)
    f_pad, k_pad = config["F_PAD"], config["K_PAD"]
    n_part = chunks if chunks > 1 else 1
    part_keys = torch.empty(B, n_part, f_pad, k_pad, dtype=torch.int64, device=dev)
    part_m = torch.empty(B, n_part, f_pad, dtype=torch.float32, device=dev)
    part_s = torch.empty_like(part_m)
    if chunks > 1:
        launch(_draft_expand_partial_kernel, (chunks, B), logits, part_keys, part_m, part_s, F, V, logits.stride(0),
               logits.stride(1), chunk, n_part, K=K, **config)
    launch(_draft_expand_kernel, (B,),
           frontier_scores.float().contiguous(), logits, part_keys, part_m, part_s,
           child_tokens, child_parents, child_scores, next_frontier, stop, log_tau.float().contiguous(),
           F, V, logits.stride(0), logits.stride(1), n_part, K=K, PARTIALS=chunks > 1, **config)
    return child_tokens, child_parents, child_scores, next_frontier, stop.view(torch.bool)
