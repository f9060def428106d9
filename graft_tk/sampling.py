"""Turning target logits into tokens: greedy, temperature and nucleus (top-p) sampling."""
from __future__ import annotations

import torch
from torch import Tensor

from .errors import InputError


def check_sampling_args(temperature: float, top_p: float) -> None:
    if not temperature >= 0.0:
        raise InputError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")


def target_probs(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """The distribution the target samples from: softmax(logits / T), cut to the top-p nucleus.

    logits: [..., V] float32 -> probs [..., V] float32 summing to 1 over the last dim.
    """
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < top_p.
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def next_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> Tensor:
    """logits [B, V] -> token ids [B] (argmax when temperature == 0)."""
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = target_probs(logits, temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
