"""``Engine``: what outlives one request — the models, the config, the candidate sources with what
they learnt (the adjacency matrix, the acceptance rates), the cost-model policy.

Requests decode in a ``graft_tk.batch.Batch`` of this engine (``generate`` is a batch of one),
through the one step of ``graft_tk.step``; a second request starts with M and the rates warm.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .acceptance import AcceptancePriors, DraftRates
from .backend import resolve_backend
from .compiled import StepForward, compile_scope
from .config import GraftConfig
from .counters import host_read
from .drafting import Drafter, ModelDrafter
from .eagle3_drafter import Eagle3Drafter
from .errors import InputError
from .methods import Method, method as as_method
from .models import Model
from .models.eagle3 import Eagle3Head
from .ops import ops_for
from .policy import DraftGate, StepPolicy
from .sampling import Sampling
from .sources import GRAFTED, AdjacencySource
from .tree import BuiltTree


class Engine:
    def __init__(self, target: Model, drafter: Model | Eagle3Head | None = None, config: GraftConfig | None = None,
                 backend: str = "auto", compile: bool | str = False, count_torch_ops: bool = False):
        """``drafter``: a small Model with the target's tokenizer or an EAGLE-3 head (None: methods
        that draft are refused). ``compile``: True / "on": the step forwards of the target and a
        drafter model run compiled (``graft_tk.compiled``); "drafter": only a drafter model's.
        ``count_torch_ops``: every step counts the torch ops it dispatches (slow;
        stats["torch_ops_per_step"])."""
        self.target, self.drafter_model = target, drafter
        self.config = config = config or GraftConfig()
        device = target.device
        self.ops = ops_for(resolve_backend(backend, device), device)
        self.compile, self.count_torch_ops = compile_scope(compile), count_torch_ops
        self.target_step = StepForward(target.net, self.compile == "on")
        # The drafter (the ``draft`` source) behind the Drafter interface, and the grafted sources.
        self.drafter: Drafter | None = as_drafter(drafter, self.compile != "off")
        self.draft_rates = DraftRates(config.priors, device)   # P(a drafted node is accepted) by its score
        # The grafted sources, created as the first request that uses each arrives (``source``).
        self.sources: list = []
        self.cand_parents = torch.zeros(0, dtype=torch.int32, device=device)
        # With the device's cost model: the drafting depth chosen per step by expected gain (one request).
        self.policy = StepPolicy(config.cost, config.top_k, config.budget) if config.cost is not None else None
        # Drafting skipped where prompt lookup already proposes what the drafter would add (one request).
        self.draft_gate = DraftGate()
        self.draft_rates_host = host_read(self.draft_rates.rate()) if self.policy is not None else None
        # Set to a list to record, per verified node, (source, depth, drafter score, accepted?):
        # graft-calibrate fits its score -> acceptance map from it. Off by default (a host read per step).
        self.acceptance_log: list[tuple[int, int, float, bool]] | None = None

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def adjacency(self) -> AdjacencySource | None:
        """The adjacency-matrix source (M and its rates), once a request has used it."""
        return next((s for s in self.sources if s.name == "adjacency"), None)

    def source(self, name: str):
        """The grafted source ``name``, created on first use (with what it learns: M, its rates)."""
        for s in self.sources:
            if s.name == name:
                return s
        config = self.config
        made = GRAFTED[name](config, self.ops, self.device, config.priors, vocab_size=self.target.config.vocab_size)
        for rates in made.rate_tables:
            rates.decay = self.draft_rates.decay
        self.sources = sorted(self.sources + [made], key=lambda s: list(GRAFTED).index(s.name))
        # The grafted candidates' fixed layout: the sources' templates concatenated (parents shifted).
        parents, at = [], 0
        for s in self.sources:
            parents.append(torch.where(s.parents < 0, -1, s.parents + at))
            at += s.parents.shape[0]
        self.cand_parents = torch.cat(parents).to(torch.int32)
        return made

    def check_request(self, ids: Sequence[int], method: Method, max_new_tokens: int) -> list[int]:
        """A request's token ids, checked (InputError naming the problem and the fix)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        ids = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if not ids:
            raise InputError("the prompt is empty; pass some text or token ids")
        V = self.target.config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise InputError(f"prompt token ids must be ints in [0, {V}); got e.g. {bad[:3]}")
        context = self.target.config.max_position_embeddings
        if len(ids) + max_new_tokens > context:
            raise InputError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                             f"context of {context} tokens; shorten the prompt or lower max_new_tokens")
        if method.drafts and self.drafter is None:
            raise InputError(f"method {method.name!r} needs a drafter: pass drafter=load_model(...) (a small model "
                             "with the same tokenizer, or the target's first layers via num_layers=L) or an EAGLE-3 "
                             "head (load_eagle3(path, target))")
        for name in GRAFTED:
            if method.uses(name):
                self.source(name)
        return ids

    def generate(self, ids: Sequence[int], method: str | Method, max_new_tokens: int, sampling: Sampling = Sampling(),
                 on_tokens: Callable[[list[int]], bool | None] | None = None) -> tuple[list[int], dict]:
        """Decode one request (a batch of one): (new tokens, stats)."""
        from .batch import Batch
        batch = Batch(self, 1)
        request = batch.add(ids, as_method(method), max_new_tokens, sampling, on_tokens)
        while not request.done:
            batch.step()
        return request.out, request.finish()

    # ----------------------------------------------------------------- what the sources learnt
    def learnt_priors(self) -> AcceptancePriors:
        """The priors the rates support now (graft-calibrate runs with decay 1 to learn from a
        whole calibration run): drafted rates per score bucket, retrieval rates pooled by rank,
        prompt-lookup rates pooled over chain positions. Syncs."""
        retrieval, retrieval_w = self.source("adjacency").learnt()
        pld, pld_w = self.source("prompt_lookup").learnt()

        def probs(xs):
            return tuple(round(min(max(x, 1e-4), 1.0), 6) for x in xs)

        def weights(xs):
            return tuple(round(x, 3) for x in xs)
        return AcceptancePriors(draft=probs(self.draft_rates.rate().tolist()), retrieval=probs(retrieval),
                                pld=probs(pld), draft_weight=weights(self.draft_rates.learnt_weight().tolist()),
                                retrieval_weight=weights(retrieval_w), pld_weight=weights(pld_w))

    def set_decay(self, decay: float) -> None:
        """Every rate's per-step decay (1: count everything, as a calibration run does)."""
        for rates in [r for s in self.sources for r in s.rate_tables] + [self.draft_rates]:
            rates.decay = decay

    def estimates_summary(self) -> dict:
        """Host copy of the current estimates (for stats and reports; syncs)."""
        return {"draft_by_score_bucket": [round(x, 4) for x in self.draft_rates.rate().tolist()],
                "retrieval_by_position": self.source("adjacency").summary(),
                "pld_by_ngram": self.source("prompt_lookup").summary()}

    def log_acceptance(self, built: BuiltTree, on_path: torch.Tensor) -> None:
        """Append (source, depth, drafter score, accepted?) of every verified node (a host read)."""
        source, depth, scores, accepted = host_read(built.source, built.depth, built.scores, on_path)
        self.acceptance_log += [(s, d, sc, bool(a)) for i, (s, d, sc, a) in enumerate(zip(source, depth, scores, accepted))
                                if i % built.tokens.shape[1] and s >= 0]


def as_drafter(drafter: Model | Eagle3Head | Drafter | None, compile: bool = False) -> Drafter | None:
    """Wrap what a caller passes as ``drafter=`` into a ``Drafter``; ``compile``: a drafter model's
    step forwards run compiled (an EAGLE-3 head, one layer, always runs eagerly)."""
    if drafter is None:
        return None
    if isinstance(drafter, Eagle3Head):
        return Eagle3Drafter(drafter)
    if isinstance(drafter, Model):
        return ModelDrafter(drafter, compile)
    return drafter
