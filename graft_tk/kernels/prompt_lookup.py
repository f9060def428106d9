"""Prompt lookup over every row of the device context buffer, in ONE launch.

Same result as the torch reference (``graft_tk.reference.prompt_lookup``): one program per batch
row sweeps its committed context in blocks of BLOCK positions; for each n-gram length n (unrolled, shortest
first) it keeps the latest window that equals the last n committed tokens and is followed by a
committed token. The longest n with a match wins; the program then gathers the L tokens after it
(-1 past the committed length). The context is read G times (G = n-gram lengths tried): 3 x 16 KB
for a 4k-token context, far below one model forward; the committed length is read on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference.prompt_lookup import check_prompt_lookup_args
from ._common import launch, next_pow2


@triton.jit
def _prompt_lookup_kernel(
    ctx_ptr, length_ptr, chain_ptr, ngram_ptr,
    n_ctx, stride_row,
    MIN_NGRAM: tl.constexpr, MAX_NGRAM: tl.constexpr, L: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)          # batch row: its context, length and outputs
    ctx_ptr += row * stride_row
    chain_ptr += row * L
    ngram_ptr += row
    length = tl.load(length_ptr + row).to(tl.int64)
    best_start = tl.full([], -1, tl.int64)
    ngram = tl.full([], 0, tl.int64)
    for n in tl.static_range(MIN_NGRAM, MAX_NGRAM + 1):
        latest = tl.full([], -1, tl.int64)
        for b in range(0, tl.cdiv(n_ctx, BLOCK)):
            i = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            ok = (i + n < length) & (n < length)
            for j in tl.static_range(n):
                at = tl.minimum(tl.maximum(length - n + j, 0), n_ctx - 1)
                suffix_tok = tl.load(ctx_ptr + at)
                tok = tl.load(ctx_ptr + i + j, mask=(i + j) < n_ctx, other=-2)
                ok = ok & (tok == suffix_tok)
            latest = tl.maximum(latest, tl.max(tl.where(ok, i, -1), axis=0))
        found = latest >= 0
        best_start = tl.where(found, latest + n, best_start)
        ngram = tl.where(found, n, ngram)
    k = tl.arange(0, BLOCK_L)
    at = tl.where(best_start >= 0, best_start, length) + k      # no match: every position invalid
    valid = (k < L) & (at < length)
    chain = tl.load(ctx_ptr + at, mask=valid, other=-1)
    tl.store(chain_ptr + k, chain, mask=k < L)
    tl.store(ngram_ptr, ngram)


def prompt_lookup(context: Tensor, length: Tensor, max_ngram: int = 3, min_ngram: int = 1,
                  max_tokens: int = 10) -> tuple[Tensor, Tensor]:
    """Same contract as ``graft_tk.reference.prompt_lookup.prompt_lookup``: (chain int64 [B, L]
    padded with -1, ngram int64 [B]) from each row's ``context[b, :length[b]]``, ``length`` [B]
    read on the device."""
    check_prompt_lookup_args(context, length, max_ngram, min_ngram, max_tokens)
    B, device = context.shape[0], context.device
    chain = torch.empty(B, max_tokens, dtype=torch.int64, device=device)
    ngram = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return chain, ngram
    if context.stride(1) != 1:
        context = context.contiguous()
    launch(_prompt_lookup_kernel, (B,), context, length.to(torch.int64).contiguous(), chain, ngram,
           context.shape[1], context.stride(0),
           MIN_NGRAM=min_ngram, MAX_NGRAM=max_ngram, L=max_tokens, BLOCK_L=next_pow2(max_tokens),
           BLOCK=1024, num_warps=4)
    return chain, ngram
