"""Turning target logits into tokens: greedy, temperature and nucleus (top-p) sampling."""
from __future__ import annotations

import secrets

import torch
from torch import Tensor

from .errors import InputError


def check_sampling_args(temperature: float, top_p: float) -> None:
    if not temperature >= 0.0:
        raise InputError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")


NUCLEUS_TOPK = 64   # the nucleus is looked for in each row's top 64 first; a wider one sorts that row


def truncated_probs(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """softmax(logits / T) with every token outside the top-p nucleus set to 0, NOT renormalised.

    logits [..., V] float32 -> [..., V] float32. The nucleus is the shortest prefix of the tokens
    sorted by probability (ties: lower token id first) whose mass reaches ``top_p``: a token is in
    it when the mass sorted before it is < top_p. Found without sorting the vocabulary: the top
    ``NUCLEUS_TOPK`` probabilities give the boundary probability p* and how many tokens equal to it
    belong in (the lowest ids among them); a row whose nucleus is wider than that is sorted in full.
    Every step is per row, so a row gives the same bits alone or in a batch (``accept`` relies on it).
    """
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    shape, V = probs.shape, probs.shape[-1]
    flat = probs.reshape(-1, V)
    top = flat.topk(min(NUCLEUS_TOPK, V), dim=-1).values                  # [R, k], descending
    n_keep = ((top.cumsum(-1) - top) < top_p).sum(-1)                      # [R], >= 1
    p_star = top.gather(-1, (n_keep - 1)[:, None])                         # boundary probability
    n_above = (top > p_star).sum(-1)
    wide = n_keep == top.shape[-1]                                         # the boundary may lie past the top-k
    if top.shape[-1] < V and bool(wide.any()):                             # rare: flat rows; one host read
        rows = wide.nonzero().squeeze(-1)
        full = flat[rows].sort(dim=-1, descending=True).values
        k_full = ((full.cumsum(-1) - full) < top_p).sum(-1)
        p_full = full.gather(-1, (k_full - 1)[:, None])
        n_keep[rows], p_star[rows], n_above[rows] = k_full, p_full, (full > p_full).sum(-1)
    tie = flat == p_star
    keep = (flat > p_star) | (tie & (tie.cumsum(-1) <= (n_keep - n_above)[:, None]))
    return flat.masked_fill(~keep, 0.0).reshape(shape)


def target_probs(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """The distribution the target samples from: softmax(logits / T), cut to the top-p nucleus
    (see ``truncated_probs``) and renormalised. logits [..., V] float32 -> probs summing to 1."""
    probs = truncated_probs(logits, temperature, top_p)
    return probs / probs.sum(-1, keepdim=True) if top_p < 1.0 else probs


def sampling_generator(device, temperature: float, seed: int | None) -> torch.Generator | None:
    """The generator a sampled request draws from (seeded: reproducible; else a fresh random seed);
    None when greedy."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2 ** 63 <= seed < 2 ** 64):
        raise InputError(f"seed must be an int in [-2**63, 2**64), got {seed!r}")
    if temperature == 0:
        return None
    generator = torch.Generator(device=device)
    # An unseeded request draws its seed from the OS, never from (or into) torch's global RNG.
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def next_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> Tensor:
    """logits [B, V] -> token ids [B] (argmax when temperature == 0)."""
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = truncated_probs(logits, temperature, top_p)   # multinomial renormalises
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
