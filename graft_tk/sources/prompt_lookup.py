"""Prompt lookup as a grafted source: the tokens after the latest earlier match of the context's
last n-gram (``ops.prompt_lookup``), as a chain under the root (candidate i under i - 1), valued
by the rate at which chain position d is accepted after a match of length g.

The matched length tells a copy from a coincidence: an answer that is copying a span of the
prompt matches the longest n-gram looked up (``pld_max_ngram``, 16), one that happens to repeat a
common pair of tokens matches 1-3. Lengths share a rate by class (1, 2, 3, 4-7, 8-15, 16-...),
so the long matches, rarer, are learnt within a request. Chain positions from
``POSITION_CLASSES - 1`` on share one rate: past the first few, how likely the next copied token
is depends on whether the answer is copying, not on how far it has copied, and a deep position is
tried too rarely to learn a rate of its own within a request (measured on 2k-token code edits:
position 10 valued at a third of what it earned)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..acceptance import PRIOR_WEIGHT, Rates, SourcePriors, lookup, outcome
from ..config import GraftConfig
from ..ops import Ops
from ..tree import PROMPT_LOOKUP, BuiltTree
from . import Candidates, CandidateSource, StepView


POSITION_CLASSES = 4
NGRAM_CLASSES = (1, 2, 3, 4, 8, 16)    # the first matched length of each class
NGRAM_PRIORS = (0.3, 0.5, 0.6, 0.75, 0.85, 0.95)   # each class's generic guess (graft-calibrate learns them)


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
        self.position = torch.arange(L, device=device).clamp(max=POSITION_CLASSES - 1)   # chain position -> rate column
        P = min(L, POSITION_CLASSES)
        # matched length g (0: none, valued as 1) -> rate row: its class
        edges = [e for e in NGRAM_CLASSES if e <= G]
        self.ngram_class = torch.tensor([max(sum(e <= g for e in edges) - 1, 0) for g in range(G + 1)], device=device)
        classes = torch.arange(len(edges), device=device)
        if priors is None:
            priors = SourcePriors(NGRAM_PRIORS, (PRIOR_WEIGHT,) * len(NGRAM_PRIORS))
        prior, weight = lookup(priors.rates, classes), lookup(priors.weights, classes)
        # rates [classes, P]: P(chain position d accepted | position d - 1 accepted, the match's
        # length class), column min(d, P - 1)
        C = len(edges)
        self.rates = Rates(prior[:, None].expand(C, P).clone(), weight[:, None].expand(C, P).clone())

    @property
    def rate_tables(self) -> tuple[Rates, ...]:
        return (self.rates,)

    def propose(self, view: StepView) -> Candidates:
        chain, ngram = self.ops.prompt_lookup(view.context, view.length, self.max_ngram, 1, self.length)
        return Candidates(chain, self.rates.rate().log()[self._row(ngram)][:, self.position], ngram)

    def expected_accepted(self, cand: Candidates) -> Tensor:
        """The chain's expected accepted length: the sum of its prefixes' probabilities."""
        p = cand.values.exp().masked_fill(cand.tokens < 0, 0.0)
        return p.cumprod(1).sum(1)

    def observe(self, built: BuiltTree, on_path: Tensor, nodes: Tensor, note: Tensor | None) -> None:
        tried, accepted = outcome(built, on_path, nodes, self.code)     # without a match nothing is tried
        cells = self._row(note)[:, None] * self.rates.prior.shape[1] + self.position
        self.rates.count(cells, tried, accepted)

    def _row(self, ngram: Tensor) -> Tensor:
        """The rates' row of a matched n-gram length (0 = no match, valued as 1)."""
        return self.ngram_class[ngram.long().clamp(0, self.max_ngram)]

    def learnt(self) -> SourcePriors:
        """Rates and weights by matched length class, pooled over chain positions."""
        r = self.rates
        n = r.n.sum(1)
        rate = (r.acc.sum(1) + r.weight[:, 0] * r.prior[:, 0]) / (n + r.weight[:, 0])
        return SourcePriors.of(rate.tolist(), r.learnt_weight(n[:, None].expand_as(r.n))[:, 0].tolist())

    def summary(self) -> list[list[float]]:
        return [[round(x, 4) for x in row] for row in self.rates.rate().tolist()]
