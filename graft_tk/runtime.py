"""``Runtime``: the models of a decode and how they run; ``KVPool``: their caches' rows.

The step reads a runtime and never changes it: the target and its step forward (eager or
compiled), the drafter behind the ``Drafter`` interface, the ops of the backend, and the pool
of KV rows. What decoding learns is ``graft_tk.state.SpecState``'s.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from .backend import resolve_backend
from .compiled import Compile, StepForward
from .drafting import Drafter, ModelDrafter, drafter_cache_slots
from .eagle3_drafter import Eagle3Drafter
from .errors import InputError
from .models import Model, exact
from .models.eagle3 import Eagle3Head
from .models.transformer import Transformer
from .ops import Ops, ops_for


class KVPool:
    """The rows of the target's and the drafter's KV caches, one per request in flight: reserved,
    viewed and moved together (request i decodes in row i of both)."""

    def __init__(self, target: Transformer, drafter: Drafter | None):
        self.target, self.drafter = target, drafter

    def reserve(self, rows: int, tokens: int, budget: int, top_k: int, max_depth: int) -> None:
        """``rows`` rows with room for a request of ``tokens`` (prompt + new) and a step's tree
        after it (``budget`` nodes; the drafter's scratch for ``top_k`` x ``max_depth``); what rows
        hold is kept."""
        self.target.setup_cache(tokens + budget + 1, batch_size=rows)
        if self.drafter is not None:
            self.drafter.reserve(rows, drafter_cache_slots(tokens, top_k, max_depth))

    @contextmanager
    def rows(self, start: int, stop: int):
        """The target's forwards inside see rows [start, stop) (the drafter views its own rows)."""
        with self.target.cache_rows(start, stop):
            yield

    def move(self, src: int, dst: int) -> None:
        """Request ``src`` now lives in row ``dst`` (a batch keeps its rows packed)."""
        self.target.kv[:, :, dst] = self.target.kv[:, :, src]
        if self.drafter is not None:
            self.drafter.move_row(src, dst)

    def commit(self, ops: Ops, src: Tensor, dst: Tensor) -> None:
        """Every row's accepted nodes' target KV from tree slots ``src`` [B, M] to ``dst`` [B] + 0 .. M - 1."""
        ops.commit_kv(self.target.kv, src, dst)


@dataclass(frozen=True, eq=False)
class Runtime:
    target: Model
    target_step: StepForward     # the target's step forward (verify), eager or compiled
    drafter: Drafter | None      # None: methods that draft are refused
    ops: Ops
    compile: Compile
    kv: KVPool
    count_torch_ops: bool = False   # every step counts the torch ops it dispatches (slow)
    exact_rows: int = 0             # > 0: the target's forwards are row-invariant (models.exact), its
                                    # attention's GEMMs padded to this many rows

    @property
    def exact(self) -> bool:
        return self.exact_rows > 0

    @property
    def target_attention(self) -> Callable:
        """The attention of the target's forwards (a drafter's run ``ops.tree_attention``); in exact
        mode a row-invariant one: the Triton kernel with the Triton backend, else the torch one."""
        if not self.exact:
            return self.ops.tree_attention
        if self.ops.backend == "triton":
            from .kernels.exact_attention import exact_attention
            return exact_attention
        return partial(exact.attention, min_rows=self.exact_rows)

    @classmethod
    def build(cls, target: Model, drafter: Model | Eagle3Head | Drafter | None = None, backend: str = "auto",
              compile: bool | str | Compile = False, count_torch_ops: bool = False, drafter_window: int | None = None,
              drafter_sink: int = 4, exact: bool = False) -> "Runtime":
        """``drafter_window`` / ``drafter_sink``: what of a prompt a drafter model reads (``ModelDrafter``);
        ``exact``: the target's forwards row-invariant (``graft_tk.models.exact``)."""
        check_drafter(target, drafter)
        compile = Compile.of(compile)
        drafter = as_drafter(drafter, compile.drafter, drafter_window, drafter_sink)
        kv = KVPool(target.net, drafter)
        ops = ops_for(resolve_backend(backend, target.device), target.device)
        rows = make_exact(target, compile) if exact else 0
        return cls(target, StepForward(target.net, compile.target), drafter, ops, compile, kv, count_torch_ops, rows)

    @property
    def device(self) -> torch.device:
        return self.target.device


def as_drafter(drafter: Model | Eagle3Head | Drafter | None, compile: bool = False, window: int | None = None,
               sink: int = 4) -> Drafter | None:
    """Wrap what a caller passes as ``drafter=`` into a ``Drafter``; ``compile``: a drafter model's
    step forwards run compiled (an EAGLE-3 head, one layer, always runs eagerly); ``window`` /
    ``sink``: what of a prompt a drafter model reads."""
    if drafter is None:
        return None
    if isinstance(drafter, Eagle3Head):
        return Eagle3Drafter(drafter)
    if isinstance(drafter, Model):
        return ModelDrafter(drafter, compile, window, sink)
    return drafter


def check_drafter(target: Model, drafter) -> None:
    """A drafter must be a Model sharing the target's tokenizer, or an EAGLE-3 head built for this target."""
    if drafter is None:
        return
    if isinstance(drafter, Eagle3Head):
        c = drafter.config
        problems = []
        if c.vocab_size != target.config.vocab_size:
            problems.append(f"vocab {c.vocab_size} vs the target's {target.config.vocab_size}")
        if c.target_hidden_size != target.config.dim:
            problems.append(f"target hidden size {c.target_hidden_size} vs the target's {target.config.dim}")
        if not all(0 <= i < target.config.n_layers for i in c.target_layers):
            problems.append(f"target layers {c.target_layers} vs the target's {target.config.n_layers} layers")
        if drafter.lm_head.weight.device != target.device:
            problems.append(f"device {drafter.lm_head.weight.device} vs the target's {target.device}")
        if problems:
            raise InputError(f"the EAGLE-3 head was not built for {target.name}: {'; '.join(problems)}; "
                             "load a head trained for this target (load_eagle3(path, target))")
        return
    if isinstance(drafter, Drafter):       # already wrapped (a custom drafter): it answers for itself
        return
    if not isinstance(drafter, Model):
        raise InputError(f"drafter must be a Model (load_model) or an EAGLE-3 head (load_eagle3), "
                         f"got {type(drafter).__name__}")
    if drafter.config.vocab_size > target.config.vocab_size:
        raise InputError(f"drafter {drafter.name} has vocab {drafter.config.vocab_size}, target {target.name} has "
                         f"{target.config.vocab_size}; the drafter must share the target's tokenizer (its vocabulary "
                         "the target's or a prefix of it)")
    differ = drafter.tokenizer.differences(target.tokenizer)
    if differ:
        token, theirs, ours = differ[0]
        raise InputError(f"drafter {drafter.name}'s tokenizer is not target {target.name}'s: {token!r} is id {theirs} "
                         f"in the drafter and {ours} in the target ({len(differ)} tokens differ); its proposals would "
                         "be other tokens than it means. Use a drafter of the target's family (the same tokenizer)")


def make_exact(target: Model, compile: Compile) -> int:
    """Make the target's forwards row-invariant (``graft_tk.models.exact``): its linear layers in
    place; returns the rows its attention's GEMMs take. CPU and eager only, for now."""
    if target.device.type != "cpu":
        raise InputError(f"exact mode runs on a CPU for now (the target is on {target.device}): the GPU kernels do "
                         "not yet give each row the same result at every width; decode without exact=True / --exact")
    if compile.target:
        raise InputError("exact mode runs the target eagerly: a compiled forward picks its own kernels per shape; "
                         "pass compile=False / 'drafter' (or drop --compile) with exact=True / --exact")
    return exact.enable(target.net)
