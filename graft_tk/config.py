"""GraftConfig: every knob of a speculative decode step, frozen and validated on construction."""
from __future__ import annotations

from dataclasses import dataclass

from .acceptance import AcceptancePriors
from .cost import StepCost
from .errors import InputError

@dataclass(frozen=True)
class GraftConfig:
    budget: int = 16        # N: tree nodes verified per target forward, root included (methods: graft_tk.methods)
    tau: float = 0.1        # drafted node kept only if its drafter path probability >= tau
    top_k: int = 4          # K: children per expanded node, and frontier width per depth
    max_depth: int = 6      # D: drafter expansions per step at most; 0: no drafting (a batch policy's
                            # choice where drafting does not pay: retrieval and prompt lookup only)
    retrieval_k: int = 8    # k: successors kept per token in the adjacency matrix M[V, k]
    template: tuple[int, ...] = (8, 21, 25, 15, 8, 3)  # retrieval template: nodes per level (TR's 80)
    # retrieval template grafted beneath the best drafted node of every depth (graft_tk.sources.adjacency);
    # (): retrieval at the root only
    tip_template: tuple[int, ...] = (2, 1, 1)
    warm_from_prefill: bool = True  # fill M from the prompt's logits before the first step
    # ... from the last ``warm_window`` positions' (None: every position's). The LM head over a
    # position costs what a prefilled token does over a 1.5B model's layers; the last ones are
    # what the answer continues, and later positions overwrite earlier ones anyway.
    warm_window: int | None = 256
    # A drafter model reads the first ``drafter_sink`` tokens and the last ``drafter_window`` of a
    # prompt (None: all of it), in the first step it drafts: a long prompt is the target's to
    # read (prompt lookup and suffix decoding read all of it), the drafter's proposals are
    # verified (a window costs acceptance, never output).
    drafter_window: int | None = 256
    drafter_sink: int = 4
    pld_tokens: int = 64    # prompt-lookup chain length (a tree holds budget - 1 of them at most)
    # The widest verify of a copy: a request decoding alone whose answer copies the context
    # verifies prompt lookup's chain as far as it is likely, up to this many nodes, where that is
    # measured faster (the draft gate's wide arm, graft_tk.policy); <= budget: never wider than N.
    copy_budget: int = 64
    pld_max_ngram: int = 16  # longest suffix n-gram looked up (down to 1): a long match is a copy
    # suffix decoding (the *suffix methods, graft_tk.sources.suffix): the longest suffix matched,
    # the latest occurrences kept (one chain each), the tokens proposed after each
    suffix_max_match: int = 8
    suffix_chains: int = 4
    suffix_tokens: int = 6
    # The device's cost model (graft-calibrate --cost-only). When set, a request of a method that
    # prunes, decoding alone, chooses whether to draft and how deep per step by expected gain
    # (graft_tk.policy); tau and max_depth become bounds. None: fixed.
    cost: StepCost | None = None
    # Where the acceptance estimates start (learnt on this pair by graft-calibrate); None: generic priors.
    priors: AcceptancePriors | None = None

    def __post_init__(self):
        _check(isinstance(self.budget, int) and self.budget >= 1, f"budget (N) must be an int >= 1, got {self.budget!r}")
        _check(0.0 < self.tau <= 1.0, f"tau must be in (0, 1], got {self.tau!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 1, f"top_k (K) must be an int >= 1, got {self.top_k!r}")
        _check(isinstance(self.max_depth, int) and self.max_depth >= 0,
               f"max_depth (D) must be an int >= 0, got {self.max_depth!r}")
        _check(isinstance(self.retrieval_k, int) and self.retrieval_k >= 1,
               f"retrieval_k must be an int >= 1, got {self.retrieval_k!r}")
        _check(len(self.template) >= 1 and all(isinstance(s, int) and s >= 1 for s in self.template),
               f"template must be a non-empty tuple of positive level sizes, got {self.template!r}")
        _check(isinstance(self.pld_tokens, int) and self.pld_tokens >= 1,
               f"pld_tokens must be an int >= 1, got {self.pld_tokens!r}")
        _check(isinstance(self.copy_budget, int) and not isinstance(self.copy_budget, bool) and self.copy_budget >= 1,
               f"copy_budget must be an int >= 1, got {self.copy_budget!r}")
        _check(isinstance(self.pld_max_ngram, int) and self.pld_max_ngram >= 1,
               f"pld_max_ngram must be an int >= 1, got {self.pld_max_ngram!r}")
        for name in ("suffix_max_match", "suffix_chains", "suffix_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"{name} must be an int >= 1, got {value!r}")
        _check(self.drafter_window is None or (isinstance(self.drafter_window, int) and self.drafter_window >= 1),
               f"drafter_window must be None (the whole prompt) or an int >= 1, got {self.drafter_window!r}")
        _check(self.warm_window is None or (isinstance(self.warm_window, int) and self.warm_window >= 1),
               f"warm_window must be None (every position) or an int >= 1, got {self.warm_window!r}")
        _check(isinstance(self.drafter_sink, int) and self.drafter_sink >= 0,
               f"drafter_sink must be an int >= 0, got {self.drafter_sink!r}")
        _check(all(isinstance(s, int) and s >= 1 for s in self.tip_template),
               f"tip_template must be a tuple of positive level sizes (or empty), got {self.tip_template!r}")
        object.__setattr__(self, "template", tuple(self.template))
        object.__setattr__(self, "tip_template", tuple(self.tip_template))
        if isinstance(self.cost, dict):     # from a profile's JSON
            object.__setattr__(self, "cost", StepCost(**self.cost))
        if isinstance(self.priors, dict):
            object.__setattr__(self, "priors", AcceptancePriors(**self.priors))
        _check(self.priors is None or isinstance(self.priors, AcceptancePriors),
               f"priors must be AcceptancePriors, got {type(self.priors).__name__}")
        if self.cost is not None:
            _check(isinstance(self.cost, StepCost), f"cost must be a StepCost, got {type(self.cost).__name__}")
            _check(len(self.cost.verify_ms) >= self.budget,
                   f"cost.verify_ms covers {len(self.cost.verify_ms)} nodes, fewer than budget {self.budget}: "
                   "remeasure with graft-calibrate --cost-only")


def verifiable(limit: int, N: int) -> int:
    """A drafting limit (depths, or children per node) capped at what a tree of N nodes can verify:
    it holds N - 1 drafted nodes (the root is one of the N), so it reaches depth N - 1 at most and no
    node in it has more children. Deeper or wider drafts are never verified."""
    return min(limit, N - 1)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InputError(message + " (see GraftConfig)")
