"""The ops of one decode step, bound to a backend: Triton kernels or their torch references.

Every op has the same signature on both backends (see ``graft_tk.kernels`` and
``graft_tk.reference``), so the engine calls ``ops.retrieve(...)`` and never asks which it got.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from .backend import resolve_backend
from .kernels import implementation

log = logging.getLogger(__name__)


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


OPS = ("draft_expand", "retrieve", "build_tree", "accept", "commit_kv", "tree_attention", "prompt_lookup")


def ops_for(backend: str, device: torch.device | str, selfcheck: bool | None = None) -> Ops:
    """The ops for ``backend`` ("auto" | "triton" | "torch") on ``device``. Triton kernels are
    checked against their references on the device first (``selfcheck``; default: on a GPU),
    and an op whose kernel fails runs its reference (``graft_tk.kernels.selfcheck``)."""
    backend = resolve_backend(backend, device)
    failed = {}
    if backend == "triton" and (torch.device(device).type == "cuda" if selfcheck is None else selfcheck):
        from .kernels import selfcheck as check
        failed = check.failed_ops(device)
    paths = {op: "torch" if backend == "torch" or op in failed else "triton" for op in OPS}
    log.info("ops on %s: %s", device, ", ".join(
        f"{op} {'Triton kernel' if path == 'triton' else 'torch reference'}" for op, path in paths.items()))
    return Ops(backend=backend, **{op: implementation(op, path) for op, path in paths.items()})
