"""The ops of one decode step, bound to a backend: Triton kernels or their torch references.

Every op has the same signature on both backends (see ``graft_tk.kernels`` and
``graft_tk.reference``), so the engine calls ``ops.retrieve(...)`` and never asks which it got.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .backend import resolve_backend


@dataclass(frozen=True)
class Ops:
    backend: str               # "triton" or "torch" (resolved)
    draft_expand: Callable     # one depth of tree expansion: top-K, cumulative scores, stop flag
    retrieve: Callable         # all retrieval template levels from the adjacency matrix
    build_tree: Callable       # prune + rerank + graft + tree tensors + mask bits
    accept: Callable           # greedy / sampling acceptance + adjacency update
    commit_kv: Callable        # move the accepted path's KV into place, all layers
    tree_attention: Callable   # the attention of every model forward: a visible prefix + a masked block
    prompt_lookup: Callable    # the longest suffix n-gram's latest match in the device context buffer


def ops_for(backend: str, device: torch.device | str) -> Ops:
    """The ops for ``backend`` ("auto" | "triton" | "torch") on ``device``."""
    backend = resolve_backend(backend, device)
    if backend == "triton":
        from .kernels import accept, build_tree, commit_kv, draft_expand, prompt_lookup, retrieve, tree_attention
    else:
        from .reference import accept, build_tree, commit_kv, draft_expand, prompt_lookup, retrieve, tree_attention
    return Ops(backend=backend, draft_expand=draft_expand.draft_expand, retrieve=retrieve.retrieve,
               build_tree=build_tree.build_tree, accept=accept.accept, commit_kv=commit_kv.commit_kv,
               tree_attention=tree_attention.tree_attention, prompt_lookup=prompt_lookup.prompt_lookup)
