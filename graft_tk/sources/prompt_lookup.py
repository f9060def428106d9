"""Prompt lookup as a grafted source: the tokens after the latest earlier match of the context's
last n-gram (``ops.prompt_lookup``), as a chain under the root (candidate i under i - 1), valued
by how long a match each position stands on.

The matched length tells a copy from a coincidence: an answer that is copying a span of the
prompt matches the longest n-gram looked up (``pld_max_ngram``, 16), one that happens to repeat a
common pair of tokens matches 1-3. Position d of a chain found by a match of length g is tried
only once positions 0 .. d - 1 were accepted, and then the context matches the source by g + d
tokens: so its rate is that of an effective match of g + d, P(accepted | effective length), one
rate per length class (1, 2, 3, 4-7, 8-15, 16-...). A chain that starts on a doubtful 1-token
match is doubtful for its first tokens and a copy from its fourth on, and every chain teaches
the classes it passes through: a request learns within a few steps that its 8-token matches
are copies (measured on 2k-token code edits: rates by (match, position) valued position 10 at a
third of what it earned, and a chain found by a short match lost the budget to the other sources)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..acceptance import PRIOR_WEIGHT, Rates, SourcePriors, lookup, outcome
from ..config import GraftConfig
from ..ops import Ops
from ..tree import PROMPT_LOOKUP, BuiltTree
from . import Candidates, CandidateSource, StepView


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
        self.offset = torch.arange(L, device=device)          # chain position d: the match grown by d
        # effective matched length g (0: none, valued as 1) -> its rate's class
        edges = [e for e in NGRAM_CLASSES if e <= G]
        self.ngram_class = torch.tensor([max(sum(e <= g for e in edges) - 1, 0) for g in range(G + 1)], device=device)
        classes = torch.arange(len(edges), device=device)
        if priors is None:
            priors = SourcePriors(NGRAM_PRIORS, (PRIOR_WEIGHT,) * len(NGRAM_PRIORS))
        # rates [classes]: P(a chain position accepted | the positions before it accepted, the
        # effective match's length class)
        self.rates = Rates(lookup(priors.rates, classes), lookup(priors.weights, classes))

    @property
    def rate_tables(self) -> tuple[Rates, ...]:
        return (self.rates,)

    def propose(self, view: StepView) -> Candidates:
        chain, ngram = self.ops.prompt_lookup(view.context, view.length, self.max_ngram, 1, self.length)
        return Candidates(chain, self.rates.rate().log()[self._cells(ngram)], ngram)

    def expected_accepted(self, cand: Candidates) -> Tensor:
        """The chain's expected accepted length: the sum of its prefixes' probabilities."""
        p = cand.values.exp().masked_fill(cand.tokens < 0, 0.0)
        return p.cumprod(1).sum(1)

    def observe(self, built: BuiltTree, on_path: Tensor, nodes: Tensor, note: Tensor | None) -> None:
        tried, accepted = outcome(built, on_path, nodes, self.code)     # without a match nothing is tried
        self.rates.count(self._cells(note), tried, accepted)

    def _cells(self, ngram: Tensor) -> Tensor:
        """[B, L]: the rate's class of each chain position after a match of ``ngram`` [B] tokens
        (0 = no match, valued as 1)."""
        return self.ngram_class[(ngram.long()[:, None] + self.offset).clamp(0, self.max_ngram)]

    def learnt(self) -> SourcePriors:
        """Rates and weights by length class."""
        return SourcePriors.of(self.rates.rate().tolist(), self.rates.learnt_weight().tolist())

    def summary(self) -> list[float]:
        return [round(x, 4) for x in self.rates.rate().tolist()]
