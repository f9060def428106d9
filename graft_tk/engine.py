"""``Engine``: what outlives one request — the models and how they run (``Runtime``), the config,
and what decoding has learnt (``SpecState``: the successor matrix M, the acceptance rates, the cost
policy, the draft gate).

Requests decode in a ``Batch`` the engine makes (``batch``; ``generate`` is a batch of one),
through the one step of ``graft_tk.step``; a second request starts with M and the rates warm.
Nothing below the engine holds it: the batch and the step are handed the runtime and the state.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from .batch import Batch
from .compiled import Compile
from .config import GraftConfig
from .drafting import Drafter
from .methods import Method
from .models import Model
from .models.eagle3 import Eagle3Head
from .request import RequestSpec
from .runtime import Runtime
from .sampling import Sampling
from .state import SpecState


class Engine:
    def __init__(self, target: Model, drafter: Model | Eagle3Head | Drafter | None = None,
                 config: GraftConfig | None = None, backend: str = "auto", compile: bool | str | Compile = False,
                 count_torch_ops: bool = False, exact: bool = False):
        """``drafter``: a small Model with the target's tokenizer or an EAGLE-3 head (None: methods
        that draft are refused). ``compile``: True / "on": the step forwards of the target and a
        drafter model run compiled (``graft_tk.compiled``); "drafter": only a drafter model's.
        ``count_torch_ops``: every step counts the torch ops it dispatches (slow;
        stats["torch_ops_per_step"]). ``exact``: the target's forwards row-invariant, so every
        method's greedy output and seeded sampling equal ``ar``'s (with ``exact=True``) in any
        dtype and batch (``graft_tk.models.exact``; CPU, eager; changes the target in place)."""
        self.config = config = config or GraftConfig()
        self.drafter_model = drafter
        self.runtime = Runtime.build(target, drafter, backend, compile, count_torch_ops, config.drafter_window,
                                     config.drafter_sink, exact)
        self.state = SpecState(config, self.runtime.ops, target.device, target.config.vocab_size,
                               fixed_width=self.runtime.compile.target)

    @property
    def target(self) -> Model:
        return self.runtime.target

    def batch(self, max_batch: int = 1, policy: Mapping[int, GraftConfig] | None = None, hold: int = 0,
              max_len: int | None = None, prefill_chunk: int | None = None,
              prefill_seconds: float | None = None) -> Batch:
        """A batch of up to ``max_batch`` requests on this engine's models and state (``graft_tk.batch``)."""
        return Batch(self.runtime, self.state, self.config, max_batch, policy, hold, max_len, prefill_chunk,
                     prefill_seconds)

    def request(self, ids: Sequence[int], method: str | Method, max_new_tokens: int,
                sampling: Sampling = Sampling()) -> RequestSpec:
        """A checked request for this engine's target."""
        return RequestSpec.of(ids, method, max_new_tokens, sampling, self.target.config)

    def generate(self, spec: RequestSpec, on_tokens: Callable[[list[int]], bool | None] | None = None,
                 on_prefill: Callable[[int, int], None] | None = None) -> tuple[list[int], dict]:
        """Decode one request (a batch of one): (new tokens, stats)."""
        batch = self.batch(1)
        request = batch.admit(spec, on_tokens, on_prefill)
        while not request.done:
            batch.step()
        return request.out, request.finish()
