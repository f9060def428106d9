"""Prompt lookup as a grafted source: the tokens after the latest earlier match of the context's
last n-gram (``ops.prompt_lookup``), as a chain under the root (candidate i under i - 1), valued
by the rate at which chain position d is accepted after a match of length g."""
from __future__ import annotations

import torch
from torch import Tensor

from ..acceptance import PRIOR_WEIGHT, Rates, SourcePriors, lookup, outcome
from ..config import GraftConfig
from ..ops import Ops
from ..tree import PROMPT_LOOKUP, BuiltTree
from . import Candidates, CandidateSource, StepView


class PromptLookupSource(CandidateSource):
    name = "prompt_lookup"
    code = PROMPT_LOOKUP
    gates = True     # its chain's expected length tells the draft gate whether the drafter is needed

    def __init__(self, config: GraftConfig, ops: Ops, device, priors: SourcePriors | None = None,
                 vocab_size: int = 0):
        super().__init__(config, ops, device)
        G, L = config.pld_max_ngram, config.pld_tokens
        self.max_ngram, self.length = G, L
        self.parents = torch.arange(-1, L - 1, dtype=torch.int32, device=device)
        ngrams = torch.arange(G, device=device)
        if priors is None:
            prior, weight = (0.3 + 0.2 * ngrams.float()).clamp(max=0.7), torch.full((G,), PRIOR_WEIGHT, device=device)
        else:
            prior, weight = lookup(priors.rates, ngrams), lookup(priors.weights, ngrams)
        # rates [G, L]: P(chain position d accepted | position d - 1 accepted, matched n-gram g + 1)
        self.rates = Rates(prior[:, None].expand(G, L).clone(), weight[:, None].expand(G, L).clone())

    @property
    def rate_tables(self) -> tuple[Rates, ...]:
        return (self.rates,)

    def propose(self, view: StepView) -> Candidates:
        chain, ngram = self.ops.prompt_lookup(view.context, view.length, self.max_ngram, 1, self.length)
        return Candidates(chain, self.rates.rate().log()[self._row(ngram)], ngram)

    def expected_accepted(self, cand: Candidates) -> Tensor:
        """The chain's expected accepted length: the sum of its prefixes' probabilities."""
        p = cand.values.exp().masked_fill(cand.tokens < 0, 0.0)
        return p.cumprod(1).sum(1)

    def observe(self, built: BuiltTree, on_path: Tensor, nodes: Tensor, note: Tensor | None) -> None:
        tried, accepted = outcome(built, on_path, nodes, self.code)     # without a match nothing is tried
        cells = self._row(note)[:, None] * self.length + torch.arange(self.length, device=nodes.device)
        self.rates.count(cells, tried, accepted)

    def _row(self, ngram: Tensor) -> Tensor:
        """The rates' row of a matched n-gram length (0 = no match, valued as 1)."""
        return ngram.long().clamp(1, self.max_ngram) - 1

    def learnt(self) -> SourcePriors:
        """Rates and weights by matched n-gram length, pooled over chain positions."""
        r = self.rates
        n = r.n.sum(1)
        rate = (r.acc.sum(1) + r.weight[:, 0] * r.prior[:, 0]) / (n + r.weight[:, 0])
        return SourcePriors.of(rate.tolist(), r.learnt_weight(n[:, None].expand_as(r.n))[:, 0].tolist())

    def summary(self) -> list[list[float]]:
        return [[round(x, 4) for x in row] for row in self.rates.rate().tolist()]
