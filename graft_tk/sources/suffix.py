"""Suffix decoding as a grafted source: what followed the latest occurrences of the context's
longest repeated suffix, as P chains that ``build_tree`` merges into a trie.

Per row, on the device, in fixed shapes (no host read, no loop over rows or tokens):

1. Match. For every position j of the committed context, m(j) <= G (``suffix_max_match``) is the
   length of the longest common suffix of ``context[:j]`` and the whole context: context[j - k] ==
   context[length - k] for k = 1 .. m(j). Every j in [1, length) with m(j) >= 1 ends an earlier
   occurrence of the context's last m(j) tokens, and context[j] followed it.
2. Select. The P (``suffix_chains``) occurrences ranked by (m desc, j desc): the latest
   occurrences of the longest match, then, where those are fewer than P, the latest of the next
   longest, and so on. Each chain keeps its own m, so a shorter match is valued by its own rates.
3. Chains. Chain p is the L (``suffix_tokens``) tokens from its j_p, cut at the context's end
   (-1 past it, and for a chain with no occurrence).

Worked example (G = 8, P = 3, L = 3), context ``1 2 3 1 2 4 1 2 3 1 2`` (positions 0 .. 10):
the suffix ``1 2`` occurs before j = 2, 5 and 8; before j = 5 the match runs on to ``1 2 3 1 2``
(m 5), before j = 8 and j = 2 it is ``1 2`` (m 2). Chains, by (m, j) desc: ``4 1 2`` (m 5), then
``3 1 2`` twice (j = 8, then j = 2: the third repeats the second, whose nodes have support 2).

Template and the trie: chain p is candidates p·L .. p·L + L - 1, its first a child of the root,
each next a child of the one before (fixed parents). Where chain p repeats an earlier chain q's
first d tokens, its first d candidates carry those tokens under the same parents, so
``build_tree`` maps them onto q's nodes ((parent node, token) exists already: no budget spent) and
p's first different token becomes a new child of the shared node: the branch re-parents itself
with fixed template parents. (Marking the repeated tokens -1 would be wrong: a candidate whose
parent is missing is missing, so p's diverging tail would be lost.) A repeated candidate is
marked in ``note`` and never counted by ``observe``: its node is counted once, for its first
chain.

Values: log P(accepted | parent accepted) from one ``Rates`` table [G, P, L], cell (m, support,
depth): m of the earliest (longest-matching) chain through the node, ``support`` the number of
chains whose path runs through the node (a token that 3 of 4 occurrences continued with beats one
that 1 continued with), depth its chain position. Priors: base(m) = min(0.3 + 0.15 (m - 1), 0.8)
(prompt lookup's curve, longer matches likelier), each supporting occurrence counting as evidence:
1 - (1 - base)^support, at most 0.9. Learnt priors (``learnt``, kept in a calibrated profile)
replace base(m) by the rate of the single-support nodes of each m.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..acceptance import LEARNT_PRIOR_WEIGHT, PRIOR_WEIGHT, Rates, SourcePriors, lookup, outcome
from ..config import GraftConfig
from ..ops import Ops
from ..tree import SUFFIX, BuiltTree
from . import Candidates, CandidateSource, StepView


def suffix_chains(context: Tensor, length: Tensor, max_match: int, n_chains: int, n_tokens: int
                  ) -> tuple[Tensor, Tensor]:
    """Per row: the continuations of the latest occurrences of the longest repeated suffix.

    Parameters
    ----------
    context : int64 [B, W]   each row's committed tokens in ``context[b, :length[b]]``; the rest is ignored
    length : int64 [B]       committed tokens per row, 1 <= length <= W
    max_match : int          G, the longest suffix matched
    n_chains, n_tokens : int P occurrences kept, L tokens after each

    Returns
    -------
    chains : int64 [B, P, L]  chain p = the tokens after occurrence p, -1 past the context or without one
    match : int64 [B, P]      each occurrence's matched length (0: none), non-increasing in p
    """
    B, W = context.shape
    G, P, L, device = max_match, n_chains, n_tokens, context.device
    length = length.long()[:, None]                                               # [B, 1]
    # windows[b, j, i] = context[b, j - G + i]: the G tokens before position j (-1 before the start)
    windows = F.pad(context, (G, 0), value=-1).unfold(1, G, 1)[:, :W]             # [B, W, G]
    at = length - G + torch.arange(G, device=device)
    suffix = torch.where(at >= 0, context.gather(1, at.clamp(min=0)), -2)         # [B, G]; -2 matches nothing
    # m(j) = how many of the tokens before j, nearest first, equal the suffix's
    match = (windows == suffix[:, None, :]).flip(-1).long().cumprod(-1).sum(-1)   # [B, W]
    j = torch.arange(W, device=device)
    match = torch.where(j < length, match, 0)
    # (m desc, j desc) as one key; -1: no occurrence there
    key = torch.where(match > 0, match * W + j, -1)
    top = key.topk(min(P, W), dim=1).values
    top = F.pad(top, (0, P - top.shape[1]), value=-1)                             # [B, P]
    found = top >= 0
    start = top.clamp(min=0) % W
    at = start[:, :, None] + torch.arange(L, device=device)                       # [B, P, L]
    ok = found[:, :, None] & (at < length[:, :, None])
    chains = torch.where(ok, context.gather(1, at.clamp(max=W - 1).view(B, P * L)).view(B, P, L), -1)
    return chains, torch.where(found, top.clamp(min=0) // W, 0)


class SuffixSource(CandidateSource):
    name = "suffix"
    code = SUFFIX

    def __init__(self, config: GraftConfig, ops: Ops, device, priors: SourcePriors | None = None,
                 vocab_size: int = 0):
        super().__init__(config, ops, device)
        G, P, L = config.suffix_max_match, config.suffix_chains, config.suffix_tokens
        self.max_match, self.chains, self.length = G, P, L
        index = torch.arange(P * L, device=device)
        self.parents = torch.where(index % L == 0, -1, index - 1).to(torch.int32)   # chain p: a path under the root
        m = torch.arange(1, G + 1, device=device)
        support = torch.arange(1, P + 1, device=device).float()
        if priors is None:
            base, weight = (0.3 + 0.15 * (m.float() - 1)).clamp(max=0.8), torch.full((G,), PRIOR_WEIGHT, device=device)
        else:
            base, weight = lookup(priors.rates, m - 1), lookup(priors.weights, m - 1)
        prior = (1 - (1 - base[:, None]) ** support[None, :]).clamp(max=0.9)       # [G, P]
        # rates [G, P, L]: P(accepted | parent accepted) by matched length, support, chain position
        self.rates = Rates(prior[:, :, None].expand(G, P, L).clone(), weight[:, None, None].expand(G, P, L).clone())

    @property
    def rate_tables(self) -> tuple[Rates, ...]:
        return (self.rates,)

    def propose(self, view: StepView) -> Candidates:
        """Tokens and values [B, P·L]; ``note`` [B, P·L]: each candidate's rate cell, -1 where it
        repeats an earlier chain's node or is missing (never counted)."""
        chains, match = suffix_chains(view.context, view.length, self.max_match, self.chains, self.length)
        B, P, L = chains.shape
        valid = chains >= 0
        # through[b, p, q, d]: chain q's first d + 1 tokens are chain p's (the same trie node)
        through = ((chains[:, :, None, :] == chains[:, None, :, :]) & valid[:, :, None, :]).long().cumprod(-1).bool()
        support = through.sum(2)                                                   # [B, P, L], >= 1 where valid
        earlier = torch.ones(P, P, dtype=torch.bool, device=chains.device).tril(-1)   # q < p
        repeat = (through & earlier[None, :, :, None]).any(2)
        # the node's matched length: its earliest chain's, the longest (chains come by m desc)
        m = torch.where(through, match[:, None, :, None], 0).amax(2)
        depth = torch.arange(L, device=chains.device)
        cell = ((m - 1).clamp(min=0) * P + (support - 1).clamp(min=0)) * L + depth
        values = self.rates.rate().log().view(-1)[cell]
        note = torch.where(valid & ~repeat, cell, -1)
        return Candidates(chains.view(B, P * L), values.view(B, P * L), note.view(B, P * L))

    def observe(self, built: BuiltTree, on_path: Tensor, nodes: Tensor, note: Tensor | None) -> None:
        tried, accepted = outcome(built, on_path, nodes, self.code)
        counted = (note >= 0).float()                  # a node several chains share counts once
        self.rates.count(note.clamp(min=0), tried * counted, accepted * counted)

    def learnt(self) -> SourcePriors:
        """base(m): the rate of the nodes one chain supports, by matched length, pooled over depth."""
        r = self.rates
        n, acc = r.n[:, 0].sum(-1), r.acc[:, 0].sum(-1)
        weight, prior = r.weight[:, 0, 0], r.prior[:, 0, 0]
        return SourcePriors.of(((acc + weight * prior) / (n + weight)).tolist(),
                               (weight + n).clamp(max=LEARNT_PRIOR_WEIGHT).tolist())

    def summary(self) -> list[float]:
        """Single-support rates by matched length, at the chain's first position."""
        return [round(x, 4) for x in self.rates.rate()[:, 0, 0].tolist()]
