"""How likely is a candidate node to be accepted? Online rates that the budget allocator ranks by.

Every candidate of a step gets an estimate, and ``build_tree`` values each tree node by
log P(its whole path is accepted) and gives the N - 1 places to the highest.
Each source keeps its own rates (``Rates``) and turns them into values for its candidates:

* drafted node (``graft_tk.drafting``): P(its path accepted | drafter score), a monotone
  (isotonic) fit over score buckets (``DraftRates``), so a likelier drafter path never gets a
  lower estimate. Prior: the drafter's own probability.
* adjacency-matrix candidate at template position i (``graft_tk.sources.adjacency``):
  P(accepted | its tree parent accepted), per position. Prior: 0.4 * 0.6**rank. ``build_tree``
  multiplies it into the parent node's value, so a chain grafted beneath a drafted node is valued
  through that node.
* prompt-lookup candidate at chain position d after a matched n-gram of length g
  (``graft_tk.sources.prompt_lookup``): P(accepted | the previous position accepted, g). Prior:
  longer matches are likelier (0.3 for g = 1, up to 0.7).
* suffix-decoding candidate (``graft_tk.sources.suffix``): P(accepted | parent accepted) by
  matched suffix length, support (how many of the chains run through the node) and depth. Prior:
  prompt lookup's curve by match length, raised by each supporting occurrence.

A grafted candidate is counted only when it made its own node (``outcome``): one whose token an
earlier source already proposed adds nothing to the tree, and counting its acceptance, which is
the other source's, made retrieval look several times likelier than it is on the nodes it adds.
Nor is it counted where a drafted sibling was accepted: children of one node are exclusive, so
a grafted source's rates are conditional on every drafted sibling being rejected, and
``build_tree`` multiplies in the share of the parent those siblings leave free (beside a drafted
token the drafter is 0.96 sure of, 0.04). Valued alone, a token beside a sure drafted one was
worth its rank's average, ~2x what such nodes were measured to earn (docs/retrieval.md §4).

Counts decay by ``DECAY`` per step, so the estimates follow a change of workload within a few
dozen steps; each prior weighs ``PRIOR_WEIGHT`` observations. ``AcceptancePriors`` learnt on the
pair (``graft-calibrate``, kept in the profile's config) replace the generic priors and weigh
what the calibration run saw of each, up to ``LEARNT_PRIOR_WEIGHT``. Everything stays on the
device in fixed shapes: reading the estimates and updating them never waits for the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .errors import InputError
from .tree import BuiltTree

SCORE_EDGES = (-6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.75, -0.5, -0.25)  # drafter log-prob buckets
PRIOR_WEIGHT = 2.0
LEARNT_PRIOR_WEIGHT = 8.0
DECAY = 0.98


@dataclass(frozen=True)
class SourcePriors:
    """Where one estimator's rates start: each rate with the observations it counts as, from
    ``PRIOR_WEIGHT`` (nothing seen: the generic guess) up to ``LEARNT_PRIOR_WEIGHT``. What the
    rates are indexed by is the estimator's own (score bucket, rank, n-gram length, ...)."""
    rates: tuple[float, ...]
    weights: tuple[float, ...]

    def __post_init__(self):
        rates = tuple(float(x) for x in self.rates)
        weights = tuple(float(x) for x in self.weights)
        if not rates or not all(0.0 < x <= 1.0 for x in rates):
            raise InputError(f"prior rates must be probabilities in (0, 1], got {rates!r}")
        if len(weights) != len(rates) or not all(PRIOR_WEIGHT <= x <= LEARNT_PRIOR_WEIGHT for x in weights):
            raise InputError(f"prior weights must hold one weight in [{PRIOR_WEIGHT}, {LEARNT_PRIOR_WEIGHT}] "
                             f"per rate, got {weights!r}")
        object.__setattr__(self, "rates", rates)
        object.__setattr__(self, "weights", weights)

    @classmethod
    def of(cls, rates, weights) -> "SourcePriors":
        """Rounded from learnt counts (rates clamped to [1e-4, 1])."""
        return cls(tuple(round(min(max(float(x), 1e-4), 1.0), 6) for x in rates),
                   tuple(round(float(x), 3) for x in weights))


@dataclass(frozen=True)
class AcceptancePriors:
    """What the estimates start from, learnt on a model pair (``SpecState.learnt_priors``):
    the drafter's P(accepted) per score bucket, and each grafted source's own, by source name
    (a source without an entry starts from its generic guess)."""
    draft: SourcePriors
    sources: dict[str, SourcePriors] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.draft, dict):     # from a profile's JSON
            object.__setattr__(self, "draft", SourcePriors(**self.draft))
        if not isinstance(self.draft, SourcePriors):
            raise InputError(f"AcceptancePriors.draft must be SourcePriors, got {type(self.draft).__name__}")
        object.__setattr__(self, "sources", {name: SourcePriors(**p) if isinstance(p, dict) else p
                                             for name, p in dict(self.sources).items()})
        bad = [name for name, p in self.sources.items() if not isinstance(p, SourcePriors)]
        if bad:
            raise InputError(f"AcceptancePriors.sources[{bad[0]!r}] must be SourcePriors")
        if len(self.draft.rates) != len(SCORE_EDGES) + 1:
            raise InputError(f"AcceptancePriors.draft needs {len(SCORE_EDGES) + 1} score buckets, got "
                             f"{len(self.draft.rates)}: relearn with graft-calibrate --cost-only")

    def of(self, source: str) -> SourcePriors | None:
        return self.sources.get(source)


def lookup(values: tuple[float, ...], index: Tensor) -> Tensor:
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


class Rates:
    """P(accepted) per cell of a fixed-shape table: decayed (trials, accepted) counts and a prior,
    ``(accepted + weight * prior) / (trials + weight)``."""

    def __init__(self, prior: Tensor, weight: Tensor, decay: float = DECAY):
        self.prior, self.weight, self.decay = prior.float(), weight.float(), decay
        self.n, self.acc = torch.zeros_like(self.prior), torch.zeros_like(self.prior)

    def rate(self) -> Tensor:
        return (self.acc + self.weight * self.prior) / (self.n + self.weight)

    def count(self, cells: Tensor, tried: Tensor, accepted: Tensor) -> None:
        """A step's outcome: decay, then add ``tried`` / ``accepted`` (float, any shape) to the
        cells of the flattened table at ``cells`` (int64, the same shape)."""
        self.n.mul_(self.decay)
        self.acc.mul_(self.decay)
        self.n.view(-1).index_add_(0, cells.reshape(-1), tried.reshape(-1).float())
        self.acc.view(-1).index_add_(0, cells.reshape(-1), accepted.reshape(-1).float())

    def learnt_weight(self, n: Tensor | None = None) -> Tensor:
        """The weight a learnt prior from these counts carries (capped)."""
        return (self.weight + (self.n if n is None else n)).clamp(max=LEARNT_PRIOR_WEIGHT)


class DraftRates(Rates):
    """P(a drafted node's path is accepted) per drafter-score bucket, non-decreasing in the score."""

    def __init__(self, priors: SourcePriors | None, device):
        self.edges = torch.tensor(SCORE_EDGES, device=device)
        if priors is None:
            mids = torch.tensor((SCORE_EDGES[0] - 1.0,) + tuple((a + b) / 2 for a, b in zip(SCORE_EDGES, SCORE_EDGES[1:]))
                                + (SCORE_EDGES[-1] / 2,), device=device)
            super().__init__(mids.exp(), torch.full((len(SCORE_EDGES) + 1,), PRIOR_WEIGHT, device=device))
        else:
            super().__init__(torch.tensor(priors.rates, device=device), torch.tensor(priors.weights, device=device))

    def rate(self) -> Tensor:
        return isotonic_fit(super().rate(), self.n + self.weight)

    def values(self, scores: Tensor) -> Tensor:
        """log P(accepted) of drafted nodes with these drafter scores (cumulative log-probs)."""
        return self.rate().log()[torch.bucketize(scores.float(), self.edges)]

    def observe(self, built: BuiltTree, on_path: Tensor) -> None:
        """Count every verified drafted node of every row by its score bucket."""
        drafted = (built.pool_index >= 0).float()
        bucket = torch.bucketize(built.scores.clamp(min=-1e4), self.edges)   # padding's -inf -> bucket 0, weight 0
        self.count(bucket, drafted, drafted * on_path.float())


def on_path_mask(path: Tensor) -> Tensor:
    """bool [B, N]: which nodes lie on each row's accepted ``path`` [B, N] (-1 padded)."""
    B, N = path.shape
    on_path = torch.zeros(B, N + 1, dtype=torch.bool, device=path.device)
    on_path.scatter_(1, torch.where(path >= 0, path, N), True)
    return on_path[:, :N]


def outcome(built: BuiltTree, on_path: Tensor, nodes: Tensor, code: int) -> tuple[Tensor, Tensor]:
    """(tried, accepted) float [B, C] of a grafted source's candidates, given the tree node each
    landed on (``nodes`` = its slice of ``built.cand_node``) and its source ``code``: tried when it
    made its own node (not one an earlier source proposed), that node's parent was accepted and
    no drafted sibling was (the rate is P(accepted | parent accepted, no drafted sibling
    accepted); ``build_tree`` multiplies in the share the drafted siblings leave free)."""
    B, N = built.parents.shape
    node = nodes.long()
    idx = node.clamp(min=0)
    parent = built.parents.long()
    parent_on_path = on_path.gather(1, parent.clamp(min=0)) | (parent < 0)
    # the nodes whose accepted child is a drafted node (column N takes everything else)
    drafted_accepted = on_path & (built.pool_index >= 0) & (parent >= 0)
    drafted_child = torch.zeros(B, N + 1, dtype=torch.bool, device=on_path.device)
    drafted_child.scatter_(1, torch.where(drafted_accepted, parent, N), True)
    open_parent = parent_on_path & ~drafted_child.gather(1, parent.clamp(min=0))
    tried = (node >= 0) & (built.source.gather(1, idx) == code) & open_parent.gather(1, idx)
    return tried.float(), (tried & on_path.gather(1, idx)).float()


def node_probs(built: BuiltTree) -> Tensor:
    """Estimated P(on the accepted path) of each node [B, N] (root and padding 0): the values
    ``build_tree`` chose the nodes by (a token two sources propose is one node)."""
    return built.values.exp().masked_fill(built.parents < 0, 0.0)
