"""How likely is a candidate node to be accepted? Online estimates that the budget allocator ranks by.

Every candidate of a step gets an estimate, and ``build_tree`` values each tree node by
log P(its whole path is accepted) and gives the N - 1 places to the highest (DESIGN.md §1 step 5):

* drafted node: P(its path accepted | drafter score), a monotone (isotonic) fit over score
  buckets, so a likelier drafter path never gets a lower estimate. Prior: the drafter's own
  probability.
* adjacency-matrix (retrieval) candidate at template position i: P(accepted | its tree parent
  accepted), per position. Prior: 0.4 * 0.6**rank. ``build_tree`` multiplies it into the
  parent node's value, so a chain grafted beneath a drafted node is valued through that node.
* prompt-lookup candidate at chain position d after a matched n-gram of length g: P(accepted |
  the previous position accepted, g). Prior: longer matches are likelier (0.3 for g = 1, up to 0.7).

A grafted candidate is counted only when it made its own node: one whose token an earlier
source (the drafter, then prompt lookup) already proposed adds nothing to the tree, and counting
its acceptance, which is the other source's, made retrieval look several times likelier than it
is on the nodes it adds.

Counts decay by ``DECAY`` per step, so the estimates follow a change of workload within a few
dozen steps; each prior weighs ``PRIOR_WEIGHT`` observations. ``AcceptancePriors`` learnt on the
pair (``graft-calibrate``, kept in the profile's config) replace the generic priors above and
weigh what the calibration run saw of each, up to ``LEARNT_PRIOR_WEIGHT``: a fresh engine then starts from what this drafter and this
adjacency matrix are actually worth, not from a guess it needs a few dozen steps to unlearn.
Everything stays on the device in fixed shapes: reading the estimates and updating them never
waits for the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .adjacency import RetrievalTemplate
from .errors import InputError
from .tree import PROMPT_LOOKUP, RETRIEVAL, BuiltTree

SCORE_EDGES = (-6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.75, -0.5, -0.25)  # drafter log-prob buckets
PRIOR_WEIGHT = 2.0
LEARNT_PRIOR_WEIGHT = 8.0
DECAY = 0.98


@dataclass(frozen=True)
class AcceptancePriors:
    """What the estimates start from, learnt on a model pair (``AcceptanceEstimates.learnt``): each
    rate with the observations it counts as, from ``PRIOR_WEIGHT`` (nothing seen: the generic
    guess) up to ``LEARNT_PRIOR_WEIGHT``."""
    draft: tuple[float, ...]      # P(drafted path accepted) per score bucket, len(SCORE_EDGES) + 1, non-decreasing
    retrieval: tuple[float, ...]  # P(accepted | parent accepted) by rank 0, 1, ... (the last repeats)
    pld: tuple[float, ...]        # P(accepted | previous accepted) by matched n-gram length 1, 2, ... (the last repeats)
    draft_weight: tuple[float, ...]
    retrieval_weight: tuple[float, ...]
    pld_weight: tuple[float, ...]

    def __post_init__(self):
        for name in ("draft", "retrieval", "pld"):
            v = tuple(float(x) for x in getattr(self, name))
            w = tuple(float(x) for x in getattr(self, name + "_weight"))
            if not v or not all(0.0 < x <= 1.0 for x in v):
                raise InputError(f"AcceptancePriors.{name} must be probabilities in (0, 1], got {v!r}")
            if len(w) != len(v) or not all(PRIOR_WEIGHT <= x <= LEARNT_PRIOR_WEIGHT for x in w):
                raise InputError(f"AcceptancePriors.{name}_weight must hold one weight in [{PRIOR_WEIGHT}, "
                                 f"{LEARNT_PRIOR_WEIGHT}] per rate, got {w!r}")
            object.__setattr__(self, name, v)
            object.__setattr__(self, name + "_weight", w)
        if len(self.draft) != len(SCORE_EDGES) + 1:
            raise InputError(f"AcceptancePriors.draft needs {len(SCORE_EDGES) + 1} score buckets, got "
                             f"{len(self.draft)}: relearn with graft-calibrate --cost-only")


def _lookup(values: tuple[float, ...], index: Tensor) -> Tensor:
    """values[index], the last value repeating past the end."""
    return torch.tensor(values, device=index.device)[index.clamp(max=len(values) - 1)]


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
                 device: torch.device | str, priors: AcceptancePriors | None = None, decay: float = DECAY):
        self.device, self.decay = torch.device(device), decay
        self.edges = torch.tensor(SCORE_EDGES, device=device)
        B, T, G, L = len(SCORE_EDGES) + 1, template.n, pld_max_ngram, pld_tokens
        self.template = template
        ranks, ngrams = template.ranks.to(device).long(), torch.arange(G, device=device)
        # each prior and the observations it counts as: [B], [T], [G, L]
        if priors is None:
            mids = torch.tensor((SCORE_EDGES[0] - 1.0,) + tuple((a + b) / 2 for a, b in zip(SCORE_EDGES, SCORE_EDGES[1:]))
                                + (SCORE_EDGES[-1] / 2,), device=device)
            self.draft_prior = mids.exp()
            self.retrieval_prior = 0.4 * 0.6 ** ranks.float()
            pld_prior = (0.3 + 0.2 * ngrams.float()).clamp(max=0.7)
            self.draft_w = torch.full((B,), PRIOR_WEIGHT, device=device)
            self.retrieval_w = torch.full((T,), PRIOR_WEIGHT, device=device)
            pld_w = torch.full((G,), PRIOR_WEIGHT, device=device)
        else:
            self.draft_prior = torch.tensor(priors.draft, device=device)
            self.retrieval_prior = _lookup(priors.retrieval, ranks)
            pld_prior = _lookup(priors.pld, ngrams)
            self.draft_w = torch.tensor(priors.draft_weight, device=device)
            self.retrieval_w = _lookup(priors.retrieval_weight, ranks)
            pld_w = _lookup(priors.pld_weight, ngrams)
        self.pld_prior, self.pld_w = pld_prior[:, None].expand(G, L), pld_w[:, None].expand(G, L)
        # (trials, accepted) counts, decayed each step
        self.draft_n, self.draft_acc = torch.zeros(B, device=device), torch.zeros(B, device=device)
        self.retrieval_n, self.retrieval_acc = torch.zeros(T, device=device), torch.zeros(T, device=device)
        self.pld_n, self.pld_acc = torch.zeros(G, L, device=device), torch.zeros(G, L, device=device)

    # ----------------------------------------------------------------- estimates (log P)
    @staticmethod
    def _rate(acc: Tensor, n: Tensor, prior: Tensor, weight: Tensor) -> Tensor:
        return (acc + weight * prior) / (n + weight)

    def draft_rates(self) -> Tensor:
        """P(a drafted node is accepted) per score bucket [B], non-decreasing in the score."""
        return isotonic_fit(self._rate(self.draft_acc, self.draft_n, self.draft_prior, self.draft_w),
                            self.draft_n + self.draft_w)

    def draft_values(self, scores: Tensor) -> Tensor:
        """log P(accepted) of drafted nodes with these drafter scores (cumulative log-probs)."""
        return self.draft_rates().log()[torch.bucketize(scores.float(), self.edges)]

    def retrieval_values(self) -> Tensor:
        """log P(accepted | tree parent accepted) of every retrieval template position [T]."""
        return self._rate(self.retrieval_acc, self.retrieval_n, self.retrieval_prior, self.retrieval_w).log()

    def pld_values(self, ngram: int | Tensor) -> Tensor:
        """log P(chain position d accepted | position d - 1 accepted) [L] after a matched n-gram of
        length ``ngram`` (an int or a 0-d device tensor; 0 = no match, valued as 1)."""
        g = self._ngram_row(ngram)
        return self._rate(self.pld_acc[g], self.pld_n[g], self.pld_prior[g], self.pld_w[g]).log()

    def _ngram_row(self, ngram: int | Tensor) -> Tensor:
        return torch.as_tensor(ngram, device=self.device).clamp(1, self.pld_n.shape[0]) - 1

    @staticmethod
    def node_probs(built: BuiltTree) -> Tensor:
        """Estimated P(on the accepted path) of each node of a built tree [N] (root and padding 0):
        the values ``build_tree`` chose the nodes by (a token two sources propose is one node)."""
        return built.values.exp().masked_fill(built.parents < 0, 0.0)

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
            counts.mul_(self.decay)
        drafted = (built.pool_index >= 0).float()
        bucket = torch.bucketize(built.scores.clamp(min=-1e4), self.edges)   # padding's -inf -> bucket 0, weight 0
        self.draft_n.scatter_add_(0, bucket, drafted)
        self.draft_acc.scatter_add_(0, bucket, drafted * on_path.float())
        if retrieval_span is not None:
            tried, accepted = self._count(built.cand_node[retrieval_span[0]:retrieval_span[1]], RETRIEVAL, built,
                                          on_path, parent_on_path)
            self.retrieval_n.add_(tried)
            self.retrieval_acc.add_(accepted)
        if pld_span is not None:    # without a match the chain is all padding: nothing is tried
            tried, accepted = self._count(built.cand_node[pld_span[0]:pld_span[1]], PROMPT_LOOKUP, built,
                                          on_path, parent_on_path)
            g = self._ngram_row(ngram).view(1)
            self.pld_n.index_add_(0, g, tried[None])
            self.pld_acc.index_add_(0, g, accepted[None])

    @staticmethod
    def _count(nodes: Tensor, source: int, built: BuiltTree, on_path: Tensor, parent_on_path: Tensor
               ) -> tuple[Tensor, Tensor]:
        """(tried, accepted) per candidate position of ``source``: tried when it made its own node
        (not one an earlier source proposed) and that node was verified with its parent accepted."""
        node = nodes.long()
        idx = node.clamp(min=0)
        tried = (node >= 0) & (built.source[idx] == source) & parent_on_path[idx]
        return tried.float(), (tried & on_path[idx]).float()

    def learnt(self) -> AcceptancePriors:
        """The priors these counts support (run with ``decay=1`` to learn from a whole calibration
        run): drafted rates per score bucket, retrieval rates pooled by rank, prompt-lookup rates
        pooled over chain positions per n-gram length, each weighing what was seen of it (a rate
        the run never observed stays the guess it was, at the weight it had). Syncs."""
        def probs(t: Tensor) -> tuple[float, ...]:
            return tuple(round(min(max(x, 1e-4), 1.0), 6) for x in t.tolist())

        def weights(prior_w: Tensor, n: Tensor) -> tuple[float, ...]:
            return tuple(round(x, 3) for x in (prior_w + n).clamp(max=LEARNT_PRIOR_WEIGHT).tolist())

        ranks = self.template.ranks.to(self.device).long()
        by_rank = lambda t: torch.zeros(int(ranks.max()) + 1, device=self.device).index_add_(0, ranks, t)  # noqa: E731
        per_rank = by_rank(torch.ones_like(self.retrieval_prior)).clamp(min=1)
        rank_prior, rank_w = by_rank(self.retrieval_prior) / per_rank, by_rank(self.retrieval_w) / per_rank
        retrieval_n, pld_n = by_rank(self.retrieval_n), self.pld_n.sum(1)
        return AcceptancePriors(
            draft=probs(self.draft_rates()),
            retrieval=probs(self._rate(by_rank(self.retrieval_acc), retrieval_n, rank_prior, rank_w)),
            pld=probs(self._rate(self.pld_acc.sum(1), pld_n, self.pld_prior[:, 0], self.pld_w[:, 0])),
            draft_weight=weights(self.draft_w, self.draft_n), retrieval_weight=weights(rank_w, retrieval_n),
            pld_weight=weights(self.pld_w[:, 0], pld_n))

    def summary(self) -> dict:
        """Host copy of the current estimates (for stats and reports; syncs): drafted paths by score
        bucket, retrieval and prompt-lookup positions given their parent accepted."""
        return {"draft_by_score_bucket": [round(x, 4) for x in self.draft_rates().tolist()],
                "retrieval_by_position": [round(x, 4) for x in self.retrieval_values().exp().tolist()],
                "pld_by_ngram": [[round(x, 4) for x in self.pld_values(g + 1).exp().tolist()]
                                 for g in range(self.pld_n.shape[0])]}
