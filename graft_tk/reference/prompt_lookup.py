"""Prompt lookup (PLD): propose the tokens that followed the last n-gram's latest earlier match.

Free candidates for text that repeats its context (code edits, summaries, RAG answers): if the
last n committed tokens also occur earlier, the tokens after that occurrence are a likely
continuation. The longest n in [min_ngram, max_ngram] with a match wins; among its matches the
latest one (closest context) wins.

Example: committed [5 6 7 9 5 6], max_ngram 3: the suffix 3-gram [9 5 6] occurs nowhere else,
the 2-gram [5 6] occurs at position 0, so the proposal is what followed it: [7 9 5 6].

A device op: the committed tokens live in a fixed-size context buffer on the device, of which
the first ``length`` are committed; every shape is the buffer's, so nothing is read back to the
host and a GPU step can run it inside a captured graph.
"""
from __future__ import annotations

import torch
from torch import Tensor


def check_prompt_lookup_args(context: Tensor, length: Tensor, max_ngram: int, min_ngram: int, max_tokens: int) -> None:
    if context.dim() != 2 or context.dtype != torch.int64:
        raise ValueError(f"context must be int64 [B, C]; got {context.dtype} {list(context.shape)}")
    if not isinstance(length, Tensor) or length.shape != context.shape[:1]:
        raise ValueError(f"length must be a tensor [B={context.shape[0]}] (each row's committed tokens)")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")


def prompt_lookup(context: Tensor, length: Tensor, max_ngram: int = 3, min_ngram: int = 1,
                  max_tokens: int = 10) -> tuple[Tensor, Tensor]:
    """Per row: the tokens after the latest earlier occurrence of the longest matching suffix n-gram.

    Parameters
    ----------
    context : Tensor, int64 [B, C]
        Each row's committed tokens (prompt + generated) in ``context[b, :length[b]]``; the rest is ignored.
    length : Tensor, int64 [B], on the context's device
        Committed tokens per row, 0 <= length <= C.
    max_ngram, min_ngram : int
        The suffix lengths tried, longest first.
    max_tokens : int
        Proposal length L.

    Returns
    -------
    chain : Tensor, int64 [B, L]
        The proposal, padded with -1 (all -1 without a match; never past ``length``).
    ngram : Tensor, int64 [B]
        The matched n-gram's length, 0 for no match.
    """
    check_prompt_lookup_args(context, length, max_ngram, min_ngram, max_tokens)
    B, C = context.shape
    device = context.device
    length = length.to(torch.long)[:, None]                                 # [B, 1]
    i = torch.arange(C, device=device)[None]                                # [1, C]
    best_start = torch.full((B,), -1, dtype=torch.long, device=device)
    ngram = torch.zeros(B, dtype=torch.long, device=device)
    for n in range(min_ngram, max_ngram + 1):           # a longer n-gram's match overrides a shorter's
        # window i..i+n-1 matches the suffix length-n..length-1 and is followed by a committed token
        ok = (i + n < length) & (n < length)
        for j in range(n):
            suffix = context.gather(1, (length - n + j).clamp(0, C - 1))    # [B, 1]
            ok &= context[:, (i[0] + j).clamp(max=C - 1)] == suffix
        latest = torch.where(ok, i, -1).max(-1).values
        found = latest >= 0
        best_start = torch.where(found, latest + n, best_start)
        ngram = torch.where(found, n, ngram)
    at = best_start[:, None] + torch.arange(max_tokens, device=device)
    valid = (best_start[:, None] >= 0) & (at < length)
    chain = torch.where(valid, context.gather(1, at.clamp(0, C - 1)), -1)
    return chain, ngram
