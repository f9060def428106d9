"""Steps 7-9's device part — verify, accept, commit — as one fixed program, a CUDA graph on CUDA.

Once ``propose`` has built the tree at its full budget N, the rest of a greedy step needs no host
value: verify the N nodes in one target forward, accept the longest path the target agrees with
(updating M), write the new tokens into the context buffer and move the path's KV to the
prefix's end. ``accept_and_commit`` is that tail after the forward; every step runs it, eager or
not. ``VerifyChain`` runs forward + tail from fixed device buffers (the tree's fields and mask
bits, the tree's first slot and the context's length as 0-d tensors), so every step is the same
program on the same addresses: on CUDA it is captured in a CUDA graph once an eager step has run
(that step resolves Triton's autotuning and the lazy initialisations a capture may not do) and
each later step is one replay, where the eager step launches several kernels per layer and a
dozen step ops, each costing host time on a GPU that waits for it. On a CPU the chain runs the
same code eagerly: there is nothing to capture, and the tests exercise every line but the capture.

The host then reads the step's outcome once (``Engine.settle``). Greedy only: a sampled step draws
its uniforms from a host generator, outside any graph.
"""
from __future__ import annotations

import warnings
from dataclasses import fields
from typing import NamedTuple

import torch
from torch import Tensor

from .backend import LAUNCHES
from .compiled import compiled_forward
from .models.transformer import Transformer, cache_visibility
from .ops import Ops
from .tree import BuiltTree, Tree


class Verdict(NamedTuple):
    """A verified tree's outcome on the device: ``path`` [N] node indices root first (-1 padded),
    ``n_path`` [] nodes on it, ``bonus`` [] the token after it, ``features`` [N, F] the target
    features a drafter reads (None unless asked)."""
    path: Tensor
    n_path: Tensor
    bonus: Tensor
    features: Tensor | None


def accept_and_commit(ops: Ops, tree: Tree, logits: Tensor, adjacency: Tensor | None, temperature: float,
                      top_p: float, uniforms: Tensor | None, context: Tensor, length: int | Tensor, kv: Tensor,
                      tree_start: int | Tensor, prefix_len: int | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Steps 8-9 on the device, no host read: accept (updating ``adjacency`` when given), write
    the accepted nodes after the root and then the bonus to ``context[length:]``, move the KV of
    the tree's slots ``tree_start + path`` to ``[prefix_len, prefix_len + n)``. Fixed shapes: all
    n rows are written; those past the path hold what the next step overwrites (context entries
    past what the host commits, cache slots past the new prefix). Returns (path, n_path, bonus)
    as ``ops.accept``."""
    path, n_path, bonus = ops.accept(tree, logits, adjacency, temperature, top_p, uniforms)
    idx = torch.arange(path.shape[0], device=path.device)
    nodes = path.clamp(min=0)
    context.index_copy_(0, length + idx, torch.where(idx == n_path - 1, bonus, tree.tokens[nodes].roll(-1)))
    ops.commit_kv(kv, tree_start + nodes, prefix_len)
    return path, n_path, bonus


def unpack_mask(bits: Tensor, n: int) -> Tensor:
    """bool [N, n] from ``BuiltTree.mask``'s packed ancestor bits (column j = bit j % 32 of word j // 32)."""
    j = torch.arange(n, device=bits.device)
    return ((bits[:, j // 32] >> (j % 32)) & 1).bool()


class VerifyChain:
    """One request's greedy verify -> accept -> commit at budget N, from fixed buffers.

    ``net``'s cache holds the prefix; the tree goes to slots [start, start + N) and its accepted
    path moves to [start, start + n_path). ``adjacency``: M to update (None: the method never
    reads it); ``context``: the request's committed-token buffer; ``hidden_layers``: target
    features for an EAGLE-3 drafter. ``compile``: the forward runs compiled (inductor; no CUDA
    graph of its own, since this chain is the one captured).
    """

    def __init__(self, net: Transformer, ops: Ops, budget: int, adjacency: Tensor | None, context: Tensor,
                 hidden_layers: tuple[int, ...] | None = None, compile: bool = False):
        device = context.device
        self.net, self.ops, self.adjacency, self.context, self.layers = net, ops, adjacency, context, hidden_layers
        self.forward = compiled_forward(net, cuda_graphs=False) if compile else net.forward_static
        N = self.n = budget
        # Inputs: copied into these before each run, read by the captured program at these addresses.
        self.tree = Tree(tokens=torch.zeros(N, dtype=torch.long, device=device),
                         parents=torch.full((N,), -1, dtype=torch.int32, device=device),
                         depth=torch.zeros(N, dtype=torch.int32, device=device),
                         source=torch.zeros(N, dtype=torch.int8, device=device),
                         scores=torch.zeros(N, device=device))
        self.mask = torch.zeros(N, (N + 31) // 32, dtype=torch.int32, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)    # the tree's first slot = prefix length
        self.length = torch.zeros((), dtype=torch.long, device=device)   # committed tokens in context
        self.capture = device.type == "cuda"
        self.graph = None
        self.launches = None   # Triton launches inside the graph (counted per replay)
        self.outputs: Verdict | None = None
        self.kv = None    # the cache the graph was captured against (a new one, e.g. grown, recaptures)

    def __call__(self, built: BuiltTree, start: int, length: int) -> Verdict:
        """Verify ``built`` (all N entries, padding masked) after ``start`` cached tokens, with
        ``length`` tokens committed to the context; the outputs stay valid until the next call."""
        if built.tokens.shape[0] != self.n:
            raise ValueError(f"the chain verifies trees of {self.n} nodes, got {built.tokens.shape[0]}")
        if start + self.n > self.net.cache_len or length + self.n > self.context.shape[0]:
            raise RuntimeError(f"a tree of {self.n} nodes after {start} cached tokens and {length} committed needs "
                               f"{start + self.n} cache slots (have {self.net.cache_len}) and {length + self.n} "
                               f"context entries (have {self.context.shape[0]}); size them before decoding")
        tree = built.as_tree()
        for f in fields(Tree):
            getattr(self.tree, f.name).copy_(getattr(tree, f.name))
        self.mask.copy_(built.mask)
        self.start.fill_(start)
        self.length.fill_(length)
        if not self.capture:
            return self._run()
        if self.graph is None or self.kv is not self.net.kv:
            return self._warm_up_or_capture()
        self.graph.replay()
        LAUNCHES.by_kernel.update(self.launches)
        return self.outputs

    def _run(self) -> Verdict:
        N, net, start = self.n, self.net, self.start
        visible = cache_visibility(net.cache_len, start, unpack_mask(self.mask, N))
        out = self.forward(self.tree.tokens.clamp(min=0)[None], (self.tree.depth.long() + start)[None],
                           start + torch.arange(N, device=start.device), visible, False, self.layers,
                           self.ops.tree_attention)
        logits, features = (out[0][0], out[1][0]) if self.layers is not None else (out[0], None)
        path, n_path, bonus = accept_and_commit(self.ops, self.tree, logits, self.adjacency, 0.0, 1.0, None,
                                                self.context, self.length, net.kv, start, start)
        return Verdict(path, n_path, bonus, features)

    def _warm_up_or_capture(self) -> Verdict:
        """CUDA: the first step (or the first on a new cache) runs eagerly; the next one captures
        the graph and replays it to run (a capture that fails warns and leaves the chain eager). Launches made while capturing are counted once (that
        replay's); each later replay adds them again (``LAUNCHES``: the step's ops run there)."""
        if self.kv is not self.net.kv:
            self.graph, self.outputs, self.kv = None, None, self.net.kv
            return self._run()
        before = LAUNCHES.snapshot()
        try:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self._run()
        except RuntimeError as e:   # e.g. an op that syncs: the step still runs, eagerly, and says so
            warnings.warn(f"the verify chain could not be captured in a CUDA graph ({e}); its steps run eagerly "
                          "(stats['verify_chain'] == 'eager')")
            self.capture, self.graph, self.outputs = False, None, None
            return self._run()
        self.launches = LAUNCHES.snapshot() - before
        self.graph.replay()
        return self.outputs
