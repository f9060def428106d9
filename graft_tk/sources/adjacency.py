"""Retrieval from the token-successor matrix M as a grafted source: at the root (Token Recycling)
and at the drafter's tips (the paper's graft).

``matrix`` M[V, k] holds, per token, the k tokens the target last ranked most likely after it
(``graft_tk.adjacency``). It is updated from every verification's logits inside ``accept`` (rows
whose method reads it) and, at a request's prefill, from the prompt's logits (``warm``).

Each step proposes, for every row:

* the retrieval template walked from the root (``ops.retrieve``); template position i is valued
  by the rate at which it is accepted once its parent is;
* where the row drafted, a small template (``GraftConfig.tip_template``) walked from the best
  drafted node of every depth d = 1 .. D (the best by estimated acceptance, kept by the pruning
  or not): its candidates are the drafted path down to that node (re-proposed, marked DRAFT, so
  they land on the drafted nodes at no cost, or bring back a pruned one at its drafter value),
  then the template beneath it, valued by its own per-position rates. So M continues where the
  drafter stopped, instead of only where M's own path from the root matched every drafted token
  (which was almost never: ``docs/retrieval.md``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..acceptance import LEARNT_PRIOR_WEIGHT, PRIOR_WEIGHT, Rates, SourcePriors, lookup, outcome
from ..adjacency import new_adjacency, template_from_level_sizes, warm_adjacency
from ..config import GraftConfig
from ..ops import Ops
from ..tree import DRAFT, RETRIEVAL, BuiltTree
from . import Candidates, CandidateSource, StepView


class AdjacencySource(CandidateSource):
    name = "adjacency"
    code = RETRIEVAL
    reads_pool = True     # its tip templates continue the drafted pool

    def __init__(self, config: GraftConfig, ops: Ops, device, priors: SourcePriors | None = None,
                 vocab_size: int = 0):
        super().__init__(config, ops, device)
        self.warms_from_prompt, self.warm_window = config.warm_from_prefill, config.warm_window
        self.template = template_from_level_sizes(config.template, config.retrieval_k).to(device)
        # M: -1 never written; ``accept`` writes the verify's top-k successors of every node
        self.matrix = self.successors = new_adjacency(vocab_size, config.retrieval_k, device)
        self.rates = Rates(*self._priors(self.template, priors, device))
        # Grafts at the drafter's tips: one block per drafted depth d = 1 .. D, the d path
        # positions then the tip template under the last (layout in ``_tip_layout``).
        self.tip_depths = config.max_depth if config.tip_template else 0
        self.tip = template_from_level_sizes(config.tip_template or (1,), config.retrieval_k).to(device)
        self.tip_rates = Rates(*self._priors(self.tip, priors, device))
        self.parents = torch.cat([self.template.parents, self._tip_layout(device)])

    @property
    def rate_tables(self) -> tuple[Rates, ...]:
        return self.rates, self.tip_rates

    @staticmethod
    def _priors(template, priors: SourcePriors | None, device) -> tuple[Tensor, Tensor]:
        """By rank (``learnt``'s pooling); generic: 0.4 * 0.6 ** rank."""
        ranks = template.ranks.long()
        if priors is None:
            return 0.4 * 0.6 ** ranks.float(), torch.full((template.n,), PRIOR_WEIGHT, device=device)
        return lookup(priors.rates, ranks), lookup(priors.weights, ranks)

    def _tip_layout(self, device) -> Tensor:
        """The tip candidates' static layout (their parents, offset by the root template's n).
        Block d (1 .. D): positions 0 .. d - 1 the drafted path to the depth-d tip, then the tip
        template's n nodes. Gathers for ``propose``: ``_take`` indexes [path tokens (D x D, tip
        row-major, by depth), tip template tokens (D x n)]; ``_is_path`` marks path positions;
        ``_cell`` is a tip-template node's rate cell."""
        D, T, n = self.tip_depths, self.template.n, self.tip.n
        parents, take, is_path, cell = [], [], [], []
        for d in range(1, D + 1):
            at = T + len(parents)                 # the block's first candidate, in the source's layout
            for j in range(d):                    # the drafted path, depth j + 1
                parents.append(at + j - 1 if j else -1)
                take.append((d - 1) * D + j)
                is_path.append(True)
                cell.append(0)
            for i, p in enumerate(self.tip.parents.tolist()):
                parents.append(at + d - 1 if p < 0 else at + d + p)
                take.append(D * D + (d - 1) * n + i)
                is_path.append(False)
                cell.append(i)
        self._take = torch.tensor(take, dtype=torch.long, device=device)
        self._is_path = torch.tensor(is_path, dtype=torch.bool, device=device)
        self._cell = torch.tensor(cell, dtype=torch.long, device=device)
        return torch.tensor(parents, dtype=torch.int32, device=device)

    def propose(self, view: StepView) -> Candidates:
        tokens = self.ops.retrieve(self.matrix, view.roots, self.template)
        values = self.rates.rate().log().expand_as(tokens)
        if not self.tip_depths:
            return Candidates(tokens, values)
        tip_tokens, tip_values = self._tips(view)
        B, T = tokens.shape
        code = torch.where(self._is_path, DRAFT, RETRIEVAL).to(torch.int8)
        return Candidates(torch.cat([tokens, tip_tokens], 1), torch.cat([values, tip_values], 1),
                          source=torch.cat([torch.full((B, T), RETRIEVAL, dtype=torch.int8, device=tokens.device),
                                            code.expand(B, -1)], 1))

    def _tips(self, view: StepView) -> tuple[Tensor, Tensor]:
        """Tokens and values [B, C_tip] of the tip blocks (-1: that depth was not drafted)."""
        B, D, device = view.roots.shape[0], self.tip_depths, view.roots.device
        C = self._take.shape[0]
        if view.pool_tokens is None:
            return torch.full((B, C), -1, dtype=torch.long, device=device), torch.zeros(B, C, device=device)
        valid = torch.arange(view.pool_tokens.shape[1], device=device) < view.pool_n[:, None]
        depths = torch.arange(1, D + 1, device=device)
        at_depth = valid[:, None, :] & (view.pool_depth[:, None, :] == depths[None, :, None])     # [B, D, P]
        best_value, tip = torch.where(at_depth, view.pool_values[:, None, :], -torch.inf).max(-1)  # [B, D]
        drafted = best_value > -torch.inf
        # Walk up from every tip at once: step k reaches the ancestor at depth d - k of the depth-d tip.
        up_tok, up_val, node = [], [], tip
        for _ in range(D):
            up_tok.append(view.pool_tokens.gather(1, node))
            up_val.append(view.pool_values.gather(1, node))
            node = view.pool_parents.gather(1, node).clamp(min=0)
        up_tok, up_val = torch.stack(up_tok, -1), torch.stack(up_val, -1)     # [B, D (tip), D (k)]
        # path[b, d - 1, j] = the depth-d tip's ancestor at depth j + 1 = up[b, d - 1, d - 1 - j]
        k = (depths[:, None] - 1 - torch.arange(D, device=device)[None, :]).clamp(min=0).expand(B, D, D)
        path_tok, path_val = up_tok.gather(2, k), up_val.gather(2, k)
        # each path node's value given its parent's (the drafter's estimate, conditional)
        cond = (path_val - torch.nn.functional.pad(path_val[:, :, :-1], (1, 0))).clamp(max=0.0)
        path_tok = path_tok.masked_fill(~drafted[:, :, None], -1)
        tips = torch.where(drafted, up_tok[:, :, 0], -1).reshape(-1)
        below = self.ops.retrieve(self.matrix, tips.clamp(min=0), self.tip).view(B, D, -1)
        below = below.masked_fill(~drafted[:, :, None], -1)
        tip_values = self.tip_rates.rate().log()
        tokens = torch.cat([path_tok.reshape(B, -1), below.reshape(B, -1)], 1)[:, self._take]
        values = torch.cat([cond.reshape(B, -1), tip_values.expand(B, D, -1).reshape(B, -1)], 1)[:, self._take]
        return tokens, values

    def observe(self, built: BuiltTree, on_path: Tensor, nodes: Tensor, note: Tensor | None) -> None:
        tried, accepted = outcome(built, on_path, nodes, self.code)
        T = self.template.n
        self.rates.count(torch.arange(T, device=nodes.device).expand_as(nodes[:, :T]), tried[:, :T], accepted[:, :T])
        if self.tip_depths:     # the tip templates' nodes (path positions are DRAFT: never counted here)
            self.tip_rates.count(self._cell.expand_as(nodes[:, T:]), tried[:, T:], accepted[:, T:])

    def warm(self, prompt: Tensor, hidden: Tensor, head, start: int = 0) -> None:
        """M's rows from a prompt's chunk: position t's logits (``head(hidden[t - start])``) follow
        ``prompt[t]``, for the positions among the prompt's last ``warm_window``."""
        first = max(start, 0 if self.warm_window is None else prompt.shape[0] - self.warm_window)
        stop = start + hidden.shape[0]
        if first < stop:
            warm_adjacency(self.matrix, prompt[first:stop], hidden[first - start:], head)

    def learnt(self) -> SourcePriors:
        """The root template's rates and weights pooled by rank."""
        r, ranks = self.rates, self.template.ranks.long()
        by_rank = lambda t: torch.zeros(int(ranks.max()) + 1, device=t.device).index_add_(0, ranks, t)  # noqa: E731
        per_rank = by_rank(torch.ones_like(r.prior)).clamp(min=1)
        prior, weight, n = by_rank(r.prior) / per_rank, by_rank(r.weight) / per_rank, by_rank(r.n)
        rate = (by_rank(r.acc) + weight * prior) / (n + weight)
        return SourcePriors.of(rate.tolist(), (weight + n).clamp(max=LEARNT_PRIOR_WEIGHT).tolist())

    def summary(self) -> list[float]:
        return [round(x, 4) for x in self.rates.rate().tolist()]
