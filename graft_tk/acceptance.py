"""How likely is a candidate node to be accepted? Online estimates that the budget allocator ranks by.

Every candidate of a step gets an estimate of log P(its whole path is accepted), and
``build_tree`` gives the N - 1 places to the highest (DESIGN.md §1 step 5):

* drafted node: P(accepted | drafter score), a monotone (isotonic) fit over score buckets, so a
  likelier drafter path never gets a lower estimate. Prior: the drafter's own probability.
* adjacency-matrix (retrieval) node at template position i: the product, along its rank path,
  of P(position j accepted | its parent accepted). Prior: 0.4 * 0.6**rank.
* prompt-lookup node at chain position d after a matched n-gram of length g: the product over
  positions <= d of P(position accepted | the previous one accepted, g). Prior: longer matches
  are likelier (0.3 for g = 1, up to 0.7).

Counts decay by ``DECAY`` per step, so the estimates follow a change of workload within a few
dozen steps; each prior weighs ``PRIOR_WEIGHT`` observations. Everything stays on the device
in fixed shapes: reading the estimates and updating them never waits for the host.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .adjacency import RetrievalTemplate
from .tree import BuiltTree

SCORE_EDGES = (-6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.75, -0.5, -0.25)  # drafter log-prob buckets
PRIOR_WEIGHT = 2.0
DECAY = 0.98


def isotonic_fit(rate: Tensor, weight: Tensor) -> Tensor:
    """Weighted least-squares non-decreasing fit of ``rate`` [B] (min-max formula, no loops):
    fit[b] = max over i <= b of min over j >= b of the weighted mean of rate[i..j]."""
    B = rate.shape[0]
    s = torch.cat([rate.new_zeros(1), torch.cumsum(rate * weight, 0)])
    w = torch.cat([weight.new_zeros(1), torch.cumsum(weight, 0)])
    i, j = torch.arange(B, device=rate.device)[:, None], torch.arange(B, device=rate.device)[None, :]
    mean = (s[j + 1] - s[i]) / (w[j + 1] - w[i]).clamp(min=1e-12)          # [i, j], valid for i <= j
    inner = torch.where(i <= j, mean, torch.inf)                           # min over j >= b, per (i, b)
    inner = torch.flip(torch.cummin(torch.flip(inner, [1]), 1).values, [1])
    outer = torch.where(i <= j, inner, -torch.inf)                         # max over i <= b
    return outer.max(0).values


class AcceptanceEstimates:
    """Device-side acceptance statistics per source; see the module docstring."""

    def __init__(self, template: RetrievalTemplate, pld_tokens: int, pld_max_ngram: int,
                 device: torch.device | str):
        self.device = torch.device(device)
        self.edges = torch.tensor(SCORE_EDGES, device=device)
        mids = torch.tensor((SCORE_EDGES[0] - 1.0,) + tuple((a + b) / 2 for a, b in zip(SCORE_EDGES, SCORE_EDGES[1:]))
                            + (SCORE_EDGES[-1] / 2,), device=device)
        self.draft_prior = mids.exp()                                       # [B]
        B, T, G, L = len(SCORE_EDGES) + 1, template.n, pld_max_ngram, pld_tokens
        self.template = template
        self.retrieval_prior = 0.4 * 0.6 ** template.ranks.to(device).float()            # [T]
        self.pld_prior = (0.3 + 0.2 * torch.arange(G, device=device).float()).clamp(max=0.7)[:, None].expand(G, L)
        # ancestor-or-self matrix of the template: a path's log value is anc @ log(rate)
        anc = torch.eye(T, device=device)
        parents = template.parents.tolist()
        for i, p in enumerate(parents):
            if p >= 0:
                anc[i] += anc[p]
        self.template_anc = anc
        # (trials, accepted) counts, decayed each step
        self.draft_n, self.draft_acc = torch.zeros(B, device=device), torch.zeros(B, device=device)
        self.retrieval_n, self.retrieval_acc = torch.zeros(T, device=device), torch.zeros(T, device=device)
        self.pld_n, self.pld_acc = torch.zeros(G, L, device=device), torch.zeros(G, L, device=device)

    # ----------------------------------------------------------------- estimates (log P)
    @staticmethod
    def _rate(acc: Tensor, n: Tensor, prior: Tensor) -> Tensor:
        return (acc + PRIOR_WEIGHT * prior) / (n + PRIOR_WEIGHT)

    def draft_rates(self) -> Tensor:
        """P(a drafted node is accepted) per score bucket [B], non-decreasing in the score."""
        return isotonic_fit(self._rate(self.draft_acc, self.draft_n, self.draft_prior), self.draft_n + PRIOR_WEIGHT)

    def draft_values(self, scores: Tensor) -> Tensor:
        """log P(accepted) of drafted nodes with these drafter scores (cumulative log-probs)."""
        return self.draft_rates().log()[torch.bucketize(scores.float(), self.edges)]

    def retrieval_values(self) -> Tensor:
        """log P(whole path accepted) of every retrieval template position [T]."""
        rate = self._rate(self.retrieval_acc, self.retrieval_n, self.retrieval_prior)
        return self.template_anc @ rate.log()

    def pld_values(self, ngram: int | Tensor) -> Tensor:
        """log P(chain accepted up to position d) [L] after a matched n-gram of length ``ngram``
        (an int or a 0-d device tensor; 0 = no match, valued as 1)."""
        g = self._ngram_row(ngram)
        return torch.cumsum(self._rate(self.pld_acc[g], self.pld_n[g], self.pld_prior[g]).log(), 0)

    def _ngram_row(self, ngram: int | Tensor) -> Tensor:
        return torch.as_tensor(ngram, device=self.device).clamp(1, self.pld_n.shape[0]) - 1

    def node_probs(self, built: BuiltTree, cand_values: Tensor) -> Tensor:
        """Estimated P(on the accepted path) of each node of a built tree [N] (root and padding 0):
        drafted nodes by their score, grafted ones by their candidate's estimate — the highest
        when several candidates (or a drafted node) land on the same node, so a token that two
        sources propose counts once."""
        N = built.tokens.shape[0]
        est = torch.zeros(N + 1, device=cand_values.device)
        node = built.cand_node.long()
        est.scatter_reduce_(0, torch.where(node >= 0, node, N), cand_values.float().exp(), "amax")
        drafted = self.draft_values(built.scores).exp().masked_fill(built.pool_index < 0, 0.0)
        return torch.maximum(est[:N], drafted)

    # ----------------------------------------------------------------- online update
    def update(self, built: BuiltTree, path: Tensor, pld_span: tuple[int, int] | None, ngram: Tensor | None,
               retrieval_span: tuple[int, int] | None) -> None:
        """Count this step's outcome. ``path``: accepted node indices, root first, padded with -1;
        ``*_span``: where each source's candidates sit in ``build_tree``'s candidate list."""
        N = built.tokens.shape[0]
        on_path = torch.zeros(N + 1, dtype=torch.bool, device=path.device)
        on_path[torch.where(path >= 0, path, N)] = True
        on_path = on_path[:N]
        parent_on_path = on_path[built.parents.long().clamp(min=0)] | (built.parents < 0)
        for counts in (self.draft_n, self.draft_acc, self.retrieval_n, self.retrieval_acc, self.pld_n, self.pld_acc):
            counts.mul_(DECAY)
        drafted = (built.pool_index >= 0).float()
        bucket = torch.bucketize(built.scores.clamp(min=-1e4), self.edges)   # padding's -inf -> bucket 0, weight 0
        self.draft_n.scatter_add_(0, bucket, drafted)
        self.draft_acc.scatter_add_(0, bucket, drafted * on_path.float())
        if retrieval_span is not None:
            tried, accepted = self._count(built.cand_node[retrieval_span[0]:retrieval_span[1]], on_path,
                                          parent_on_path)
            self.retrieval_n.add_(tried)
            self.retrieval_acc.add_(accepted)
        if pld_span is not None:    # without a match the chain is all padding: nothing is tried
            tried, accepted = self._count(built.cand_node[pld_span[0]:pld_span[1]], on_path, parent_on_path)
            g = self._ngram_row(ngram).view(1)
            self.pld_n.index_add_(0, g, tried[None])
            self.pld_acc.index_add_(0, g, accepted[None])

    @staticmethod
    def _count(nodes: Tensor, on_path: Tensor, parent_on_path: Tensor) -> tuple[Tensor, Tensor]:
        """(tried, accepted) per candidate position: tried when its node was verified with its
        parent accepted."""
        node = nodes.long()
        verified = node >= 0
        idx = node.clamp(min=0)
        tried = verified & parent_on_path[idx]
        return tried.float(), (tried & on_path[idx]).float()

    def summary(self) -> dict:
        """Host copy of the current estimates (for stats and reports; syncs)."""
        return {"draft_by_score_bucket": [round(x, 4) for x in self.draft_rates().tolist()],
                "retrieval_by_position": [round(x, 4) for x in self.retrieval_values().exp().tolist()],
                "pld_by_ngram": [[round(x, 4) for x in self.pld_values(g + 1).exp().tolist()]
                                 for g in range(self.pld_n.shape[0])]}
