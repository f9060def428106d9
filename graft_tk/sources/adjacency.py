"""Root-parallel retrieval from the token-successor matrix M as a grafted source (Token Recycling).

``matrix`` M[V, k] holds, per token, the k tokens the target last ranked most likely after it
(``graft_tk.adjacency``). It is updated from every verification's logits inside ``accept`` (rows
whose method reads it) and, at a request's prefill, from the prompt's logits (``warm``). Each
step walks the retrieval template from every row's root (``ops.retrieve``); template position i
is valued by the rate at which it is accepted once its parent is.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..acceptance import PRIOR_WEIGHT, AcceptancePriors, Rates, lookup, outcome
from ..adjacency import new_adjacency, template_from_level_sizes, warm_adjacency
from ..config import GraftConfig
from ..ops import Ops
from ..tree import RETRIEVAL, BuiltTree
from . import Candidates, StepView


class AdjacencySource:
    name = "adjacency"
    code = RETRIEVAL

    def __init__(self, config: GraftConfig, ops: Ops, device, priors: AcceptancePriors | None = None,
                 vocab_size: int = 0):
        self.ops, self.warm_from_prefill = ops, config.warm_from_prefill
        self.template = template_from_level_sizes(config.template, config.retrieval_k).to(device)
        self.parents = self.template.parents
        self.matrix = new_adjacency(vocab_size, config.retrieval_k, device)   # -1: never written
        ranks = self.template.ranks.long()
        if priors is None:
            prior, weight = 0.4 * 0.6 ** ranks.float(), torch.full((self.template.n,), PRIOR_WEIGHT, device=device)
        else:
            prior, weight = lookup(priors.retrieval, ranks), lookup(priors.retrieval_weight, ranks)
        self.rates = Rates(prior, weight)

    def propose(self, view: StepView) -> Candidates:
        tokens = self.ops.retrieve(self.matrix, view.roots, self.template)
        return Candidates(tokens, self.rates.rate().log().expand_as(tokens))

    def observe(self, built: BuiltTree, on_path: Tensor, nodes: Tensor, note: Tensor | None) -> None:
        tried, accepted = outcome(built, on_path, nodes, self.code)
        self.rates.count(torch.arange(self.template.n, device=nodes.device).expand_as(nodes), tried, accepted)

    def warm(self, prompt: Tensor, hidden: Tensor, head) -> None:
        """M's rows from a prefill: position t's logits (``head(hidden[t])``) follow ``prompt[t]``."""
        warm_adjacency(self.matrix, prompt, hidden, head)

    def learnt(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(rates, weights) pooled by rank (AcceptancePriors.retrieval)."""
        r, ranks = self.rates, self.template.ranks.long()
        by_rank = lambda t: torch.zeros(int(ranks.max()) + 1, device=t.device).index_add_(0, ranks, t)  # noqa: E731
        per_rank = by_rank(torch.ones_like(r.prior)).clamp(min=1)
        prior, weight, n = by_rank(r.prior) / per_rank, by_rank(r.weight) / per_rank, by_rank(r.n)
        rate = (by_rank(r.acc) + weight * prior) / (n + weight)
        return tuple(rate.tolist()), tuple((weight + n).clamp(max=8.0).tolist())

    def summary(self) -> list[float]:
        return [round(x, 4) for x in self.rates.rate().tolist()]
