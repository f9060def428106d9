"""Step forwards, eager or compiled: what a decode step runs through a model after its prefill.

``StepForward(net, compile)`` has ``Transformer.forward``'s signature. Eager, it is the model's
forward. Compiled, it runs that forward under ``torch.compile(fullgraph=True)`` with the plan's
key bound set to the whole static cache, so no shape and no Python value depends on the context
length. A target's graph is specialised to its first shape (a one-token ``ar`` step, the verify at
the batch's shape) and made symbolic in a size once that changes (dynamo's automatic dynamic). A
drafter, whose forwards change width (the committed tokens it has not seen, the frontier), is
compiled with symbolic sizes (``dynamic``) from the start, and so reads only the keys of its
context (the plan's bound): one graph serves every context length.

On a CPU the graphs compile with inductor's ``freezing`` (the weights become constants, float
ones packed for oneDNN) and, for a model with quantized weights, GEMM autotuning
(``max_autotune_gemm``): for every linear layer and call width inductor times its C++ GEMM
templates (micro-kernels that unpack int4 / int8 weights in registers, flat in the number of rows
where torch's packed weight-only kernels loop over them) against the aten kernel and keeps the
faster, caching its choices. A float model skips the search: oneDNN's packed GEMM is its fast
path. Both are config values read while a graph compiles, so they are set around every call
(``torch.compile(options=...)`` does not switch freezing on). An ``a8w8`` layer's integer product
stays oneDNN's, an opaque op in the graph (``graft_tk::onednn_int8_sums``); its rounding and
scaling compile around it. On CUDA the graph is captured in a CUDA graph (``mode="reduce-overhead"``).

A prompt's prefill (``StepForward.prefill``) runs eagerly, except for a quantized model compiled
on a CPU with AMX: there the eager int4 / int8 kernels loop over the prompt's rows, so the prompt
runs in fixed chunks of ``PREFILL_CHUNK`` tokens through one more graph whose GEMMs are flat in
the rows (the last chunk padded: its padding's K/V land past the prompt, where later tokens
overwrite them before anything reads them). Without AMX the templates cost more than the eager
loop, so the prefill stays eager. Compilation happens once per model and shape in a process
(``compiled_forward`` keeps them) and takes minutes on a small CPU; ``Compile.DRAFTER`` compiles
only a drafter model's forwards. The measurements behind each choice: docs/roofline.md.
"""
from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Callable, Sequence

import torch
from torch import Tensor

from ._cpu import cpu_info
from .errors import InputError
from .models.attention import AttentionPlan
from .models.quant import QuantLinear
from .models.transformer import Part, Transformer

# Compiled forwards per model: Dynamo keys its graphs by code object, so every Transformer of the
# process shares one limit of cached graphs (target and drafter widths, test models).
_COMPILED: "weakref.WeakKeyDictionary[Transformer, dict]" = weakref.WeakKeyDictionary()
_GRAPHS_PER_CODE = 64
PREFILL_CHUNK = 64    # tokens per compiled prefill chunk (one graph for every prompt length)
EAGER_PREFILL_CHUNK = 512   # tokens per eager prefill forward (a 2k-token prompt of the 1.5B Qwen reads as fast as whole)
class Compile(enum.Enum):
    """What runs compiled: nothing, a drafter model's step forwards, or every step forward."""
    OFF = "off"
    DRAFTER = "drafter"
    ON = "on"

    @classmethod
    def of(cls, compile: "bool | str | Compile") -> "Compile":
        """``compile`` as a scope: True is ON, False OFF, a string its value."""
        if isinstance(compile, cls):
            return compile
        if isinstance(compile, bool):
            return cls.ON if compile else cls.OFF
        try:
            return cls(compile)
        except ValueError:
            raise InputError(f"compile must be True, False or one of {', '.join(repr(c.value) for c in cls)}, "
                             f"got {compile!r}") from None

    def __str__(self) -> str:
        return self.value

    @property
    def target(self) -> bool:
        return self is Compile.ON

    @property
    def drafter(self) -> bool:
        return self is not Compile.OFF


def compiled_forward(net: Transformer, dynamic: bool = False):
    """``net.forward`` compiled with no graph break (raises if one is needed); ``dynamic``: sizes
    symbolic from the first call (else specialised, and symbolic only once one changes)."""
    by_mode = _COMPILED.setdefault(net, {})
    if dynamic not in by_mode:
        if net.compute_weight.device.type == "cuda":
            fn = graph_limited(torch.compile(net.forward, fullgraph=True, dynamic=dynamic or None,
                                             mode="reduce-overhead"))
        else:   # freezing (and for a quantized model GEMM autotuning) on, so every graph has them
            fn = graph_limited(torch.compile(net.forward, fullgraph=True, dynamic=dynamic or None),
                               freezing=True, max_autotune_gemm=quantized(net))
        by_mode[dynamic] = fn
    return by_mode[dynamic]


def graph_limited(fn, **inductor_options):
    """``fn`` run with dynamo's limit of graphs per code object raised to ``_GRAPHS_PER_CODE`` and
    ``inductor_options`` set in inductor's config. Both are set around every call: inductor reads
    its flags while a graph compiles (``torch.compile(options=...)`` did not switch freezing on),
    and dynamo's config is per thread: graft-serve decodes in a thread of its own, where a limit
    set once at start-up was not seen (it stayed 8, and with fullgraph the 9th shape failed its
    request)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    def run(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=_GRAPHS_PER_CODE), inductor_config.patch(**inductor_options):
            return fn(*args, **kwargs)
    return run


def amx_cpu() -> bool:
    """Whether this CPU has AMX tiles (inductor's int4 / int8 GEMM templates are then flat in the rows)."""
    return "amx_tile" in cpu_info()[1]


def quantized(net: Transformer) -> bool:
    """Whether ``net`` has weight-only quantized linear layers."""
    return any(isinstance(m, QuantLinear) for m in net.modules())


class StepForward:
    """A model's step forward (``Transformer.forward`` arguments), compiled or not."""

    def __init__(self, net: Transformer, compile: bool = False, dynamic: bool = False):
        self.net = net
        self.compiled = compiled_forward(net, dynamic) if compile else None
        self._cuda_graphs = compile and net.compute_weight.device.type == "cuda"
        self.symbolic = dynamic and not self._cuda_graphs     # a CUDA graph replays fixed shapes
        self.chunked_prefill = compile and not self._cuda_graphs and quantized(net) and amx_cpu()

    def prefill(self, tokens: Tensor, hidden_layers: tuple[int, ...] | None = None, attention=None,
                progress: Callable[[int, int], None] | None = None, start: int = 0, stop: int | None = None,
                grid: int | None = None):
        """A prompt ``tokens`` [B, n] into cache slots 0 .. n - 1: its last position's logits
        [B, 1, V] (and with ``hidden_layers``, every position's, as ``Transformer.forward``).
        Read EAGER_PREFILL_CHUNK tokens a forward (PREFILL_CHUNK, padded, where the compiled
        chunks run): a long prompt's activations stay small and ``progress(done, n)`` is called
        after each chunk. ``start`` / ``stop``: only positions start .. stop - 1, slots before
        ``start`` already read (a prompt read over several calls; the logits are of stop - 1).
        ``grid``: eager forwards end at multiples of it (exact mode: every reading of a prompt
        runs the same forwards; ``start`` and ``stop`` are then multiples of it or the end)."""
        B, n = tokens.shape
        device = tokens.device
        C = PREFILL_CHUNK if self.chunked_prefill else grid or EAGER_PREFILL_CHUNK
        logits, hidden = None, []
        end = n if stop is None else stop
        for s in range(start, end, C):
            t = min(C, end - s)
            if self.chunked_prefill and s + C <= self.net.cache_len:
                chunk = tokens.new_zeros(B, C)      # a fresh [B, C]: a slice's strides would recompile
                chunk[:, :t] = tokens[:, s:s + t]
                last = torch.full((B,), t - 1, device=device)     # a tensor: no graph per value
                out = self(chunk, torch.arange(s, s + C, device=device), s, logits_at=last,
                           hidden_layers=hidden_layers, attention=attention)
            else:   # eagerly (a compiled chunk's padding would run past the cache)
                out = self.net(tokens[:, s:s + t], torch.arange(s, s + t, device=device), s, logits_at=-1,
                               hidden_layers=hidden_layers, attention=attention)
            logits = out if hidden_layers is None else out[0]
            if hidden_layers is not None:
                hidden.append(out[1][:, :t])
            if progress is not None:
                progress(s + t, n)
        return logits if hidden_layers is None else (logits, torch.cat(hidden, dim=1))

    def packed(self, parts: Sequence[Part], attention=None) -> list:
        """Several parts in one forward (``Transformer.forward_packed``, always eager)."""
        return self.net.forward_packed(parts, attention)

    def __call__(self, tokens: Tensor, positions: Tensor, plan: AttentionPlan | int, logits_at=None,
                 hidden_layers: tuple[int, ...] | None = None, attention=None):
        if self.compiled is None:
            return self.net(tokens, positions, plan, logits_at, hidden_layers, attention)
        if isinstance(plan, int):
            plan = AttentionPlan.causal(plan, tokens.shape[0], tokens.shape[1], tokens.device)
        plan.check(tokens.shape[0], tokens.shape[1], self.net.cache_len)
        if not self.symbolic:
            # Every key of the static cache (visibility masks the rest): the graph's shapes never
            # depend on how long the context is. A graph with symbolic sizes reads the keys of its
            # context alone: one graph serves every count, and a server's 4096-slot cache is not
            # read whole by every drafter forward.
            plan = dataclasses.replace(plan, keys=self.net.cache_len)
        out = self.compiled(tokens, positions, plan, logits_at, hidden_layers, attention, kv=self.net.kv,
                            rope=self.net.rope)
        if self._cuda_graphs:   # a CUDA graph's outputs are overwritten by its next replay
            out = tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()
        return out
