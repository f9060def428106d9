"""A request: what was asked (``RequestSpec``, validated once) and where its decoding stands (``Request``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .errors import InputError
from .methods import Method, method as as_method
from .models.transformer import ModelConfig
from .sampling import Sampling
from .stats import RequestStats


@dataclass(frozen=True)
class RequestSpec:
    """One request as asked: prompt token ids, method, length limit and sampling; ``of`` checks
    it against the target, so whatever takes a spec (``decode``, ``Batch``, graft-serve) takes a
    valid one."""
    ids: tuple[int, ...]
    method: Method
    max_new_tokens: int
    sampling: Sampling = Sampling()

    @classmethod
    def of(cls, ids: Sequence[int] | torch.Tensor, method: str | Method, max_new_tokens: int, sampling: Sampling,
           target: ModelConfig) -> "RequestSpec":
        """A checked spec (InputError naming the problem and the fix); the sampling seeded."""
        method = as_method(method)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        ids = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if not ids:
            raise InputError("the prompt is empty; pass some text or token ids")
        V = target.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise InputError(f"prompt token ids must be ints in [0, {V}); got e.g. {bad[:3]}")
        context = target.max_position_embeddings
        if len(ids) + max_new_tokens > context:
            raise InputError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                             f"context of {context} tokens; shorten the prompt or lower max_new_tokens")
        return cls(tuple(ids), method, max_new_tokens, sampling.seeded())

    @property
    def tokens(self) -> int:
        """Context it needs at most: prompt + new tokens."""
        return len(self.ids) + self.max_new_tokens


@dataclass(eq=False)
class Request:
    """One request in decoding: its spec and where it stands (host ints; its tokens live in its
    batch row's context on the device)."""
    spec: RequestSpec
    on_tokens: Callable[[list[int]], bool | None] | None
    stats: RequestStats
    length: int = 0          # committed tokens, prompt first; the last one is the next tree's root
    target_len: int = 0      # committed tokens whose KV is in the target cache (all but the root)
    out: list[int] = field(default_factory=list)   # new tokens so far (what was streamed)
    done: bool = False
    on_prefill: Callable[[int, int], None] | None = None   # (prompt tokens read, prompt tokens)

    @property
    def method(self) -> Method:
        return self.spec.method

    @property
    def sampling(self) -> Sampling:
        return self.spec.sampling

    def finish(self) -> dict:
        """The request's stats (``DecodeResult.stats``)."""
        return self.stats.finish(len(self.spec.ids), len(self.out))

    def take(self, new: list[int], eos: tuple[int, ...]) -> list[int]:
        """Commit ``new`` tokens: EOS and ``max_new_tokens`` cut them; stream them; returns what was kept."""
        for i, tok in enumerate(new):
            if tok in eos or len(self.out) + i + 1 >= self.spec.max_new_tokens:
                new, self.done = new[:i + 1], True
                break
        self.out += new
        if self.on_tokens and self.on_tokens(new):
            self.done = True
        return new
