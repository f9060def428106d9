"""GraftConfig: every knob of a speculative decode step, frozen and validated on construction."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError

# Methods, all at the same verification budget N so that comparisons are fair:
#   ar         plain decoding, one target forward per token
#   tree       drafter-only tree of fixed depth D, EAGLE-2 rerank to N
#   pruned     drafter tree with calibrated dynamic depth (tau); freed budget left unused
#   retrieval  Token Recycling: adjacency-matrix candidates only, no drafter
#   graft      pruned drafter tree + retrieval candidates filling the freed budget
#   pld        prompt lookup: the tokens that followed the last n-gram earlier in the context
METHODS = ("ar", "tree", "pruned", "retrieval", "graft", "pld")
USES_DRAFTER = {"tree", "pruned", "graft"}
USES_RETRIEVAL = {"retrieval", "graft"}


@dataclass(frozen=True)
class GraftConfig:
    budget: int = 16        # N: tree nodes verified per target forward, root included
    tau: float = 0.1        # drafted node kept only if its drafter path probability >= tau
    top_k: int = 4          # K: children per expanded node, and frontier width per depth
    max_depth: int = 6      # D: drafter expansions per step at most
    retrieval_k: int = 8    # k: successors kept per token in the adjacency matrix M[V, k]
    template: tuple[int, ...] = (8, 21, 25, 15, 8, 3)  # retrieval template: nodes per level (TR's 80)
    warm_from_prefill: bool = True  # fill M from the prompt's logits before the first step
    pld_tokens: int = 10    # prompt-lookup chain length (method pld, and graft's second source)
    pld_max_ngram: int = 3  # longest suffix n-gram looked up (down to 1)
    graft_with_pld: bool = True  # graft also fills its freed budget with the prompt-lookup chain

    def __post_init__(self):
        _check(isinstance(self.budget, int) and self.budget >= 1, f"budget (N) must be an int >= 1, got {self.budget!r}")
        _check(0.0 < self.tau <= 1.0, f"tau must be in (0, 1], got {self.tau!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 1, f"top_k (K) must be an int >= 1, got {self.top_k!r}")
        _check(isinstance(self.max_depth, int) and self.max_depth >= 1,
               f"max_depth (D) must be an int >= 1, got {self.max_depth!r}")
        _check(isinstance(self.retrieval_k, int) and self.retrieval_k >= 1,
               f"retrieval_k must be an int >= 1, got {self.retrieval_k!r}")
        _check(len(self.template) >= 1 and all(isinstance(s, int) and s >= 1 for s in self.template),
               f"template must be a non-empty tuple of positive level sizes, got {self.template!r}")
        _check(isinstance(self.pld_tokens, int) and self.pld_tokens >= 1,
               f"pld_tokens must be an int >= 1, got {self.pld_tokens!r}")
        _check(isinstance(self.pld_max_ngram, int) and self.pld_max_ngram >= 1,
               f"pld_max_ngram must be an int >= 1, got {self.pld_max_ngram!r}")
        object.__setattr__(self, "template", tuple(self.template))

    def uses_prompt_lookup(self, method: str) -> bool:
        return method == "pld" or (method == "graft" and self.graft_with_pld)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InputError(message + " (see GraftConfig)")
