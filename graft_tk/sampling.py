"""The target's choice at every node: greedy, or a draw that depends only on (seed, position).

Greedy: the argmax (ties: the lowest token id).

Sampling: the token at sequence position t is drawn by inverse CDF — token ids in increasing
order, cumulative probabilities in float64 — from the target's distribution there (softmax of
logits / T, cut to the top-p nucleus, renormalised), at ONE uniform ``u(seed, t)`` that is a
fixed function of the request's seed and the position (53 bits, ``position_uniforms``). Plain
decoding with these uniforms is exact ancestral sampling: every position has its own uniform,
used once.

Speculative decoding verifies against the same draws: a tree node is accepted when its token is
the target's draw at its parent's position (given the parent's path), and the bonus is the draw at
the last accepted node. So the accepted tokens ARE the plain sampled decode's tokens with that
seed, whatever the tree held: sampled output is token-identical to ``ar`` with the same seed,
for every method, batch composition and state of the adjacency matrix (up to the floating-point
differences a different batch shape may cause). The acceptance probability is the usual one:
P(the draw is one of the node's children) = the sum of their probabilities, as with the
residual-resampling rule for candidates fixed before the draw.

What makes the uniform independent of the tree: a tree is built from committed tokens (drawn at
earlier positions), the adjacency matrix (raw logits) and acceptance counts of committed steps;
none reads a uniform of a position not yet committed.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import InputError

MIN_TEMPERATURE = 1e-5   # below it a request decodes greedily (its distribution is the argmax but for near-ties)
NUCLEUS_TOPK = 64        # the nucleus is looked for in each row's top 64 first; a wider one sorts that row


@dataclass(frozen=True)
class Sampling:
    """How one request turns the target's logits into tokens. ``temperature`` < ``MIN_TEMPERATURE``
    (0 included) is greedy; ``seed`` fixes every draw (None: drawn from the OS when the request
    starts, never from torch's global RNG; ``seeded()`` gives the copy with it set)."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        check_sampling_args(self.temperature, self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2 ** 63 <= self.seed < 2 ** 64):
            raise InputError(f"seed must be an int in [-2**63, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def seeded(self) -> "Sampling":
        """This request's sampling with a seed: its own, or a fresh one from the OS."""
        return self if self.seed is not None or self.greedy else Sampling(self.temperature, self.top_p,
                                                                          secrets.randbits(63))

    @property
    def key(self) -> int:
        """The seed as the int64 the uniforms are derived from (0 when greedy)."""
        return _signed((self.seed or 0) % 2 ** 64)


def check_sampling_args(temperature: float, top_p: float) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0.0:
        raise InputError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p!r}")


# --------------------------------------------------------------------------- uniforms
_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix(z: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; >> made logical by masking)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _signed(_MIX1)
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _signed(_MIX2)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def position_uniforms(keys: Tensor, positions: Tensor) -> Tensor:
    """u(key, position) in (0, 1), float64 with 53 random bits: ``keys`` int64 broadcast against
    ``positions`` int64. A fixed function (changing it changes every seeded output);
    ``tests/test_sampling.py`` pins it against a pure-Python copy."""
    z = _mix(_mix(positions.long() * _signed(_GOLDEN) + _signed(_GOLDEN)) ^ keys.long())
    return (((z >> 11) & ((1 << 53) - 1)).double() + 0.5) * 2.0 ** -53


# --------------------------------------------------------------------------- distributions
def truncated_probs(logits: Tensor, temperature: float | Tensor, top_p: float | Tensor) -> Tensor:
    """softmax(logits / T) with every token outside the top-p nucleus set to 0, NOT renormalised.

    logits [..., V] (float32 or float64; the result has its dtype); ``temperature`` and ``top_p``
    numbers or tensors broadcasting against [..., 1] (each row its own). The nucleus is the
    shortest prefix of the tokens sorted by probability (ties: lower token id first) whose mass
    reaches ``top_p``: a token is in it when the mass sorted before it is < top_p. Found without
    sorting the vocabulary: the top ``NUCLEUS_TOPK`` probabilities give the boundary probability
    p* and how many tokens equal to it belong in (the lowest ids among them); a row whose nucleus
    is wider than that is sorted in full. Every step is per row, so a row gives the same bits
    alone or in a batch.
    """
    probs = torch.softmax(logits / temperature, dim=-1)
    if not isinstance(top_p, Tensor) and top_p >= 1.0:
        return probs
    shape, V = probs.shape, probs.shape[-1]
    flat = probs.reshape(-1, V)
    p_cut = torch.as_tensor(top_p, dtype=probs.dtype, device=probs.device).expand(*shape[:-1], 1).reshape(-1, 1)
    top = flat.topk(min(NUCLEUS_TOPK, V), dim=-1).values                  # [R, k], descending
    n_keep = ((top.cumsum(-1) - top) < p_cut).sum(-1)                      # [R], >= 1
    p_star = top.gather(-1, (n_keep - 1)[:, None])                         # boundary probability
    n_above = (top > p_star).sum(-1)
    wide = (n_keep == top.shape[-1]) & (p_cut[:, 0] < 1.0)                  # the boundary may lie past the top-k
    if top.shape[-1] < V and bool(wide.any()):                             # rare: flat rows; one host read
        rows = wide.nonzero().squeeze(-1)
        full = flat[rows].sort(dim=-1, descending=True).values
        k_full = ((full.cumsum(-1) - full) < p_cut[rows]).sum(-1)
        p_full = full.gather(-1, (k_full - 1)[:, None])
        n_keep[rows], p_star[rows], n_above[rows] = k_full, p_full, (full > p_full).sum(-1)
    tie = flat == p_star
    keep = (flat > p_star) | (tie & (tie.cumsum(-1) <= (n_keep - n_above)[:, None])) | (p_cut >= 1.0)
    return flat.masked_fill(~keep, 0.0).reshape(shape)


def target_probs(logits: Tensor, temperature: float | Tensor, top_p: float | Tensor) -> Tensor:
    """The distribution the target samples from: softmax(logits / T), cut to the top-p nucleus
    (see ``truncated_probs``) and renormalised. logits [..., V] -> probs summing to 1."""
    probs = truncated_probs(logits, temperature, top_p)
    return probs / probs.sum(-1, keepdim=True)


# --------------------------------------------------------------------------- the choice
def choose(logits: Tensor, positions: Tensor, sampling: list[Sampling]) -> Tensor:
    """The target's token at every node: logits [B, N, V] float32, ``positions`` [B, N] int64 (the
    sequence position of the token being chosen: the node's position + 1), ``sampling`` one per
    row -> [B, N] int64. Greedy rows: argmax. Sampled rows: the inverse-CDF draw at
    ``position_uniforms(seed, position)`` (module docstring), computed in float64."""
    choice = logits.argmax(-1)
    if all(s.greedy for s in sampling):
        return choice
    device = logits.device
    sampled = torch.tensor([not s.greedy for s in sampling], device=device)
    temperature = torch.tensor([max(s.temperature, MIN_TEMPERATURE) for s in sampling], dtype=torch.float64,
                               device=device)[:, None, None]
    top_p = torch.tensor([s.top_p for s in sampling], dtype=torch.float64, device=device)[:, None, None]
    keys = torch.tensor([s.key for s in sampling], device=device)[:, None]
    probs = truncated_probs(logits.double(), temperature, top_p)          # [B, N, V], mass <= 1
    cdf = probs.cumsum(-1)
    u = position_uniforms(keys, positions)                                 # [B, N]
    draw = torch.searchsorted(cdf, (u * cdf[..., -1])[..., None], right=True)[..., 0]
    return torch.where(sampled[:, None], draw.clamp(max=logits.shape[-1] - 1), choice)
