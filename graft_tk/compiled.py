"""Step forwards, eager or compiled: what a decode step runs through a model after its prefill.

``StepForward(net, compile)`` has ``Transformer.forward``'s signature. Eager, it is the model's
forward. Compiled, it runs ``Transformer.forward_static`` under ``torch.compile(fullgraph=True)``:
the slots and the visibility over the whole static cache are built here (two small device ops),
so the compiled graph sees the same shapes at every step — one graph for a target's verify at its
fixed budget N, one for a one-token ``ar`` step; a drafter, whose forwards change width (the
committed tokens it has not seen, the frontier), is compiled with symbolic sizes (``dynamic``),
one graph for one row and one for many. On a CPU inductor's
``freezing`` packs the weights for oneDNN/MKL; on CUDA the graph is captured in a CUDA graph
(``mode="reduce-overhead"``), except the target's greedy verify, which runs inside the larger
graph of ``graft_tk.verify_chain`` (verify -> accept -> commit). The prefill, whose length differs per prompt, always runs eagerly.

Compilation happens once per model and shape in a process (``compiled_forward`` keeps them), and
takes minutes on a small CPU: it pays off over long generations and servers, not one short call.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

from .errors import InputError
from .models.transformer import Transformer, attention_mask, cache_visibility

# Compiled forward_static per model: Dynamo keys its graphs by code object, so every Transformer
# of the process shares one limit of cached graphs (target and drafter widths, test models).
_COMPILED: "weakref.WeakKeyDictionary[Transformer, dict]" = weakref.WeakKeyDictionary()
_GRAPHS_PER_CODE = 64


def compiled_forward(net: Transformer, dynamic: bool = False, cuda_graphs: bool = True):
    """``net.forward_static`` compiled with no graph break (raises if one is needed); ``dynamic``:
    sizes symbolic from the first call (else specialised, and symbolic only once one changes);
    ``cuda_graphs=False``: on CUDA, no CUDA graph of its own (a caller captures it in a larger one,
    ``graft_tk.verify_chain``)."""
    by_mode = _COMPILED.setdefault(net, {})
    cuda = net.compute_weight.device.type == "cuda"
    key = (dynamic, cuda_graphs and cuda)
    if key not in by_mode:
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _GRAPHS_PER_CODE)
        if cuda:
            fn = torch.compile(net.forward_static, fullgraph=True, dynamic=dynamic or None,
                               mode="reduce-overhead" if cuda_graphs else None)
        else:
            fn = torch.compile(net.forward_static, fullgraph=True, dynamic=dynamic or None,
                               options={"freezing": True})
        by_mode[key] = fn
    return by_mode[key]


class StepForward:
    """A model's step forward (``Transformer.forward`` arguments), compiled or not."""

    def __init__(self, net: Transformer, compile: bool = False, dynamic: bool = False):
        self.net = net
        self.compiled = compiled_forward(net, dynamic) if compile else None
        self._cuda_graphs = compile and net.compute_weight.device.type == "cuda"

    def __call__(self, tokens: Tensor, positions: Tensor, start: int, attn_mask: Tensor | None = None,
                 last_only: bool = False, mask_prefix: int | None = None,
                 hidden_layers: tuple[int, ...] | None = None, attention=None):
        if self.compiled is None:
            return self.net(tokens, positions, start, attn_mask=attn_mask, last_only=last_only,
                            mask_prefix=mask_prefix, hidden_layers=hidden_layers, attention=attention)
        T, device = tokens.shape[1], tokens.device
        if start + T > self.net.cache_len:
            raise RuntimeError(f"KV cache holds {self.net.cache_len} slots; call setup_cache(>= {start + T})")
        # The eager forward's mask (checked; causal when attn_mask is None), spread over the whole cache.
        mask = attention_mask(attention, start, T, attn_mask, mask_prefix, device)
        if mask.per_sequence is not None:
            raise InputError("a per-sequence attn_mask [B, T, S] runs eagerly only; use compile=False")
        block = mask.block if mask.block is not None else torch.ones(T, T, dtype=torch.bool, device=device).tril()
        visible = cache_visibility(self.net.cache_len, mask.prefix_len, block)
        slots = torch.arange(start, start + T, device=device)
        out = self.compiled(tokens, positions, slots, visible, last_only, hidden_layers, attention)
        if self._cuda_graphs:   # a CUDA graph's outputs are overwritten by its next replay
            out = tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()
        return out
