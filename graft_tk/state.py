"""``SpecState``: what decoding learns, with one owner.

Every estimate that steps update and later steps read lives here: the grafted sources (the
adjacency matrix M, every source's acceptance rates), the drafter's rates by score, the cost
policy and the draft gate, and the acceptance log graft-calibrate fits from. The step receives
the state and counts its outcome into it; nothing else holds learnt state. An ``Engine`` keeps
one for its life, so a second request starts with M and the rates warm; a fresh state is a
cold start (graft-bench's equal start for every method).
"""
from __future__ import annotations

import torch

from .acceptance import AcceptancePriors, DraftRates, SourcePriors
from .config import GraftConfig
from .counters import host_read
from .errors import InputError
from .methods import Method
from .ops import Ops
from .policy import Controllers, DraftGate, PlainCheck, StepController, StepPolicy
from .sources import CandidateSource, registered
from .tree import BuiltTree

FIXED = StepController()   # the config as it is: no method that prunes, or a batch without a cost model


class SpecState:
    """The learnt state of one engine (see the module docstring). ``fixed_width``: the verify
    keeps its budget (a compiled target forward: every new width would compile a graph)."""

    def __init__(self, config: GraftConfig, ops: Ops, device, vocab_size: int, fixed_width: bool = False):
        self.config, self.ops, self.device, self.vocab_size = config, ops, device, vocab_size
        priors = config.priors
        # The grafted sources in graft order, created as the first request that uses each arrives (``admit``).
        self.sources: list[CandidateSource] = []
        self.cand_parents = torch.zeros(0, dtype=torch.int32, device=device)   # their layouts, concatenated
        # With the device's cost model: drafting and the verify's width by expected gain per ms.
        self.policy = (StepPolicy(config.cost, config.top_k, config.budget, fixed_width=fixed_width)
                       if config.cost is not None else None)
        self.fixed_width = fixed_width
        self.batch_policies: dict[int, StepController] = {}     # batch size -> its cost policy (and plain check)
        # no drafting where the free sources already propose; a copy verified as far as it goes
        self.gate = DraftGate(0 if fixed_width or config.copy_budget <= config.budget else config.copy_budget)
        self.draft_rates = DraftRates(priors.draft if priors else None, device)   # P(accepted | drafter score)
        # Set to a list to record, per verified node, (source code, depth, drafter score, accepted?):
        # graft-calibrate fits its score -> acceptance map from it. None: off (a host read per step).
        self.acceptance_log: list[tuple[int, int, float, bool]] | None = None

    # ----------------------------------------------------------------- sources
    def admit(self, method: Method) -> None:
        """Create the sources ``method`` draws on that no request has used yet."""
        known = registered()
        have = {s.name for s in self.sources}
        new = [name for name in known if method.uses(name) and name not in have]
        if not new:
            return
        priors = self.config.priors
        for name in new:
            source = known[name](self.config, self.ops, self.device, priors.of(name) if priors else None,
                                 vocab_size=self.vocab_size)
            for rates in source.rate_tables:
                rates.decay = self.draft_rates.decay
            self.sources.append(source)
        order = list(known)
        self.sources.sort(key=lambda s: order.index(s.name))
        if sum(s.successors is not None for s in self.sources) > 1:
            raise InputError("two sources own a successor table; the accept op fills one per step")
        # The grafted candidates' fixed layout: the sources' templates concatenated (parents shifted).
        parents, at = [], 0
        for s in self.sources:
            parents.append(torch.where(s.parents < 0, -1, s.parents + at))
            at += s.parents.shape[0]
        self.cand_parents = torch.cat(parents).to(torch.int32)

    def source(self, name: str) -> CandidateSource | None:
        """The source ``name``, once a request has used it."""
        return next((s for s in self.sources if s.name == name), None)

    @property
    def successors(self) -> CandidateSource | None:
        """The source whose table the accept op fills from the verify's logits (M), if any."""
        return next((s for s in self.sources if s.successors is not None), None)

    # ----------------------------------------------------------------- controllers
    def controller(self, methods: list[Method]) -> StepController:
        """The controllers of a batch of requests of ``methods``: a request decoding alone whose
        method prunes is steered by the cost policy (with a cost model) and the draft gate (when
        one of its sources signals it); several requests of which one prunes, by the cost policy
        of that batch size; anything else runs its config as it is."""
        if not any(m.prune for m in methods):
            return FIXED
        if len(methods) > 1:
            if self.config.cost is None:
                return FIXED
            B = len(methods)
            if B not in self.batch_policies:
                c = self.config
                policy = StepPolicy(c.cost, c.top_k, c.budget, fixed_width=self.fixed_width, rows=B)
                # a compiled target's verify keeps one width: no plain steps between its trees
                self.batch_policies[B] = policy if self.fixed_width else Controllers(PlainCheck(), policy)
            return self.batch_policies[B]
        parts = [self.gate] if any(s.gates and methods[0].uses(s.name) for s in self.sources) else []
        if self.policy is not None:
            parts.append(self.policy)
        return Controllers(*parts) if parts else FIXED

    # ----------------------------------------------------------------- what was learnt
    def learnt_priors(self) -> AcceptancePriors:
        """The priors the rates support now (graft-calibrate runs with decay 1 to learn from a
        whole calibration run), for every source used so far. Syncs."""
        draft = SourcePriors.of(self.draft_rates.rate().tolist(), self.draft_rates.learnt_weight().tolist())
        learnt = {s.name: s.learnt() for s in self.sources}
        return AcceptancePriors(draft, {name: p for name, p in learnt.items() if p is not None})

    def set_decay(self, decay: float) -> None:
        """Every rate's per-step decay (1: count everything, as a calibration run does)."""
        for rates in [r for s in self.sources for r in s.rate_tables] + [self.draft_rates]:
            rates.decay = decay

    def log_acceptance(self, built: BuiltTree, on_path: torch.Tensor) -> None:
        """Append (source, depth, drafter score, accepted?) of every verified node (a host read)."""
        source, depth, scores, accepted = host_read(built.source, built.depth, built.scores, on_path)
        N = built.tokens.shape[1]
        self.acceptance_log += [(s, d, sc, bool(a)) for i, (s, d, sc, a) in enumerate(zip(source, depth, scores, accepted))
                                if i % N and s >= 0]
