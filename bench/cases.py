"""The op benchmark cases, shared by the pytest-benchmark suite and bench/gpu_check.py.

A case is (op name, shape label, a function that builds the arguments on a device). Shapes are
those of real decode steps: Qwen2.5-1.5B (vocab 151,936, 12 query / 2 kv heads of dim 128, 28
layers), budget N = 16 (default) and 64, top-K = 4, the 80-node retrieval template with k = 8.
Arguments are built from seeded CPU generators, then moved, so every machine times the same data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from graft_tk.adjacency import default_template, new_adjacency
from graft_tk.reference.retrieve import retrieve
from graft_tk.tree import PROMPT_LOOKUP, RETRIEVAL, Tree

VOCAB = 151936
K = 4


@dataclass(frozen=True)
class Case:
    op: str                      # module name in graft_tk.kernels / graft_tk.reference
    fn: str                      # function name, the same in both
    label: str                   # shape, for the table
    build: Callable              # device -> (args tuple); fresh for every backend (ops may write in place)
    quick: bool = True           # part of the small set (--quick, CPU dry runs)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def branchy_tree(n: int, device) -> Tree:
    """n nodes, two children per node (a balanced binary tree)."""
    return Tree.from_lists(list(range(100, 100 + n)), [-1] + [(i - 1) // 2 for i in range(1, n)], device=device)


def filled_adjacency(vocab: int, device, k: int = 8) -> torch.Tensor:
    """A fully written M, so retrieval walks every template node (the worst case)."""
    adj = new_adjacency(vocab, k)
    adj.copy_(torch.randint(0, vocab, adj.shape, generator=_gen(), dtype=torch.int32))
    return adj.to(device)


def _draft_expand(frontier: int, vocab: int, rows: int = 1):
    def build(device):
        logits = torch.randn(rows, frontier, vocab, generator=_gen()).to(device)
        scores = (-torch.rand(rows, frontier, generator=_gen(1))).to(device) if frontier > 1 else \
            torch.zeros(rows, 1, device=device)
        return scores, logits, K, torch.full((rows,), math.log(0.1), device=device)
    return build


def _retrieve(vocab: int, rows: int = 1):
    def build(device):
        return filled_adjacency(vocab, device), torch.arange(7, 7 + rows, device=device), default_template(8).to(device)
    return build


def _build_tree(budget: int, vocab: int = VOCAB, depth: int = 6, rows: int = 1):
    def build(device):
        P = K + (depth - 1) * K * K
        g = _gen()
        tokens = torch.randint(vocab, (rows, P), generator=g)
        parents = torch.cat([torch.full((K,), -1), torch.arange(P - K) // K]).long()   # K children per node
        depths = torch.zeros(P, dtype=torch.long)
        for i in range(P):
            depths[i] = 1 if parents[i] < 0 else depths[parents[i]] + 1
        scores = -depths.float() - torch.rand(rows, P, generator=g)                   # deeper = lower
        template = default_template(8)
        roots = torch.arange(7, 7 + rows)
        cand = retrieve(filled_adjacency(vocab, "cpu"), roots, template)
        L = 10
        chain = torch.randint(vocab, (rows, L), generator=g)
        tp = template.parents.long()
        cand_parents = torch.cat([torch.arange(-1, L - 1), torch.where(tp < 0, -1, tp + L)]).to(torch.int32)
        cand_source = torch.tensor([PROMPT_LOOKUP] * L + [RETRIEVAL] * template.n, dtype=torch.int8)
        to = lambda t: t.to(device)  # noqa: E731
        # estimated log P(accepted), as the engine passes them: drafted from the score, candidates falling with depth
        cand_values = -torch.rand(rows, L + template.n, generator=g) - torch.cat([torch.arange(L), template.depth.long()])
        return (to(tokens), to(parents.expand(rows, -1)), to(scores), to(depths.expand(rows, -1)),
                to(torch.full((rows,), P)), to(roots), to(torch.full((rows,), math.log(0.05))),
                to(torch.cat([chain, cand], 1)), to(cand_parents), to(cand_source), budget, to(scores * 1.5),
                to(cand_values))
    return build


def _accept(nodes: int, vocab: int = VOCAB, rows: int = 1):
    """``rows`` copies of a balanced tree, logits per node; the choice is the argmax (the walk's cost
    does not depend on how it was chosen) and M is updated."""
    def build(device):
        tree = branchy_tree(nodes, device)
        logits = torch.randn(rows, nodes, vocab, generator=_gen()).to(device) * 3
        expand = lambda t: t[None].expand(rows, *t.shape).contiguous()  # noqa: E731
        return (expand(tree.tokens), expand(tree.parents), expand(tree.depth), expand(tree.packed_mask()),
                logits.argmax(-1), logits, new_adjacency(vocab, 8, device))
    return build


def _commit_kv(layers: int, heads: int, slots: int, head_dim: int, n: int, dtype, rows: int = 1):
    def build(device):
        kv = torch.randn(layers, 2, rows, heads, slots, head_dim, generator=_gen()).to(dtype).to(device)
        start = slots - 64
        src = start + torch.arange(n) * 2                 # every other tree slot: an overlapping move
        return kv, src.expand(rows, -1).contiguous().to(device), torch.full((rows,), start, device=device)
    return build


def _tree_attention(T: int, prefix: int, dtype, hq: int = 12, hkv: int = 2, d: int = 128, rows: int = 1):
    """``rows`` trees over prefixes of ``prefix`` keys and shorter (a ragged batch)."""
    def build(device):
        g = _gen()
        q = torch.randn(rows, hq, T, d, generator=g).to(dtype).to(device)
        k = torch.randn(rows, hkv, prefix + T, d, generator=g).to(dtype).to(device)
        v = torch.randn(rows, hkv, prefix + T, d, generator=g).to(dtype).to(device)
        block = branchy_tree(T, "cpu").attn_mask()[None].expand(rows, -1, -1).contiguous().to(device)
        prefixes = torch.tensor([prefix - i * prefix // (2 * rows) for i in range(rows)], device=device)
        return q, k, v, prefixes, block, prefix + T
    return build


def _prompt_lookup(committed: int, spare: int = 128, rows: int = 1):
    def build(device):
        # a small alphabet repeats n-grams often, so lookups find matches as in code or summaries
        context = torch.cat([torch.randint(0, 64, (rows, committed), generator=_gen()),
                             torch.full((rows, spare), -1)], 1)
        return context.to(device), torch.full((rows,), committed).to(device), 3, 1, 10
    return build


def _quant_matmul(M: int, N: int, K: int, mode: str, dtype, bias: bool = False):
    """x [M, K] times an int8 / int4 weight [N, K] (random integers, scales around 0.01)."""
    def build(device):
        g = _gen()
        x = torch.randn(M, K, generator=g).to(dtype)
        if mode == "int8":
            q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
            scales, zeros = (torch.rand(N, generator=g) * 0.02).to(dtype), None
        else:
            q = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
            scales = (torch.rand(N, K // 32, generator=g) * 0.02).to(dtype)
            zeros = (torch.randn(N, K // 32, generator=g) * 0.02).to(dtype).to(device)
        b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
        return x.to(device), q.to(device), scales.to(device), zeros, 32, b
    return build


CASES = [
    Case("draft_expand", "draft_expand", f"B=1 F=1 V={VOCAB} K={K}", _draft_expand(1, VOCAB)),
    Case("draft_expand", "draft_expand", f"B=1 F=4 V={VOCAB} K={K}", _draft_expand(K, VOCAB), quick=False),
    Case("draft_expand", "draft_expand", f"B=4 F=4 V={VOCAB} K={K}", _draft_expand(K, VOCAB, 4), quick=False),
    Case("retrieve", "retrieve", "B=1 80-node template, k=8", _retrieve(VOCAB)),
    Case("retrieve", "retrieve", "B=4 80-node template, k=8", _retrieve(VOCAB, 4), quick=False),
    Case("build_tree", "build_tree", "B=1 P=84 C=90 N=16", _build_tree(16)),
    Case("build_tree", "build_tree", "B=1 P=84 C=90 N=64", _build_tree(64), quick=False),
    Case("build_tree", "build_tree", "B=4 P=84 C=90 N=16", _build_tree(16, rows=4), quick=False),
    Case("accept", "accept", f"B=1 N=16 V={VOCAB}", _accept(16)),
    Case("accept", "accept", f"B=1 N=64 V={VOCAB}", _accept(64), quick=False),
    Case("accept", "accept", f"B=4 N=16 V={VOCAB}", _accept(16, rows=4), quick=False),
    Case("commit_kv", "commit_kv", "B=1 28 layers, 2x128, n=6, bf16", _commit_kv(28, 2, 4096, 128, 6, torch.bfloat16)),
    Case("commit_kv", "commit_kv", "B=4 28 layers, 2x128, n=16, bf16",
         _commit_kv(28, 2, 4096, 128, 16, torch.bfloat16, rows=4), quick=False),
    Case("tree_attention", "tree_attention", "B=1 T=16 prefix=1024 12:2 d128 bf16",
         _tree_attention(16, 1024, torch.bfloat16)),
    Case("tree_attention", "tree_attention", "B=1 T=64 prefix=4096 12:2 d128 bf16",
         _tree_attention(64, 4096, torch.bfloat16), quick=False),
    Case("tree_attention", "tree_attention", "B=1 T=1 prefix=4096 12:2 d128 bf16",
         _tree_attention(1, 4096, torch.bfloat16), quick=False),
    Case("tree_attention", "tree_attention", "B=4 T=16 prefix<=1024 ragged 12:2 d128 bf16",
         _tree_attention(16, 1024, torch.bfloat16, rows=4), quick=False),
    Case("prompt_lookup", "prompt_lookup", "B=1 context 256, n-gram 3..1, L=10", _prompt_lookup(256)),
    Case("prompt_lookup", "prompt_lookup", "B=4 context 4096, n-gram 3..1, L=10", _prompt_lookup(4096, rows=4),
         quick=False),
    Case("quant_matmul", "quant_matmul", "int4 M=1 qkv 1536->2048 +bias bf16",
         _quant_matmul(1, 2048, 1536, "int4", torch.bfloat16, bias=True)),
    Case("quant_matmul", "quant_matmul", "int8 M=1 qkv 1536->2048 +bias bf16",
         _quant_matmul(1, 2048, 1536, "int8", torch.bfloat16, bias=True), quick=False),
    Case("quant_matmul", "quant_matmul", "int4 M=1 gate/up 1536->2x8960 bf16",
         _quant_matmul(1, 17920, 1536, "int4", torch.bfloat16), quick=False),
    Case("quant_matmul", "quant_matmul", "int4 M=16 gate/up 1536->2x8960 bf16",
         _quant_matmul(16, 17920, 1536, "int4", torch.bfloat16), quick=False),
    Case("quant_matmul", "quant_matmul", "int8 M=1 down 8960->1536 bf16",
         _quant_matmul(1, 1536, 8960, "int8", torch.bfloat16), quick=False),
]


def implementation(case: Case, backend: str):
    """The reference op ("torch") or the Triton kernel ("triton") of a case."""
    import importlib
    package = "graft_tk.kernels" if backend == "triton" else "graft_tk.reference"
    return getattr(importlib.import_module(f"{package}.{case.op}"), case.fn)
