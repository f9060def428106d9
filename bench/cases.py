"""The op benchmark cases, shared by the pytest-benchmark suite and bench/gpu_check.py.

A case is (op name, shape label, a function that builds the arguments on a device). Shapes are
those of real decode steps: Qwen2.5-1.5B (vocab 151,936, 12 query / 2 kv heads of dim 128, 28
layers), budget N = 16 (default) and 64, top-K = 4, the 80-node retrieval template with k = 8.
Arguments are built by ``graft_tk.kernels.probes`` (seeded CPU generators, then moved), so every
machine times the same data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from graft_tk.kernels.probes import K, accept, build_tree, commit_kv, draft_expand, prompt_lookup, \
    quant_matmul, retrieve, tree_attention

VOCAB = 151936


@dataclass(frozen=True)
class Case:
    op: str                      # module name in graft_tk.kernels / graft_tk.reference
    fn: str                      # function name, the same in both
    label: str                   # shape, for the table
    build: Callable              # device -> (args tuple); fresh for every backend (ops may write in place)
    quick: bool = True           # part of the small set (--quick, CPU dry runs)


CASES = [
    Case("draft_expand", "draft_expand", f"B=1 F=1 V={VOCAB} K={K}", draft_expand(1, VOCAB)),
    Case("draft_expand", "draft_expand", f"B=1 F=4 V={VOCAB} K={K}", draft_expand(K, VOCAB), quick=False),
    Case("draft_expand", "draft_expand", f"B=4 F=4 V={VOCAB} K={K}", draft_expand(K, VOCAB, 4), quick=False),
    Case("retrieve", "retrieve", "B=1 80-node template, k=8", retrieve(VOCAB)),
    Case("retrieve", "retrieve", "B=4 80-node template, k=8", retrieve(VOCAB, 4), quick=False),
    Case("build_tree", "build_tree", "B=1 P=84 C=90 N=16", build_tree(16, VOCAB)),
    Case("build_tree", "build_tree", "B=1 P=84 C=90 N=64", build_tree(64, VOCAB), quick=False),
    Case("build_tree", "build_tree", "B=4 P=84 C=90 N=16", build_tree(16, VOCAB, rows=4), quick=False),
    Case("accept", "accept", f"B=1 N=16 V={VOCAB}", accept(16, VOCAB)),
    Case("accept", "accept", f"B=1 N=64 V={VOCAB}", accept(64, VOCAB), quick=False),
    Case("accept", "accept", f"B=4 N=16 V={VOCAB}", accept(16, VOCAB, rows=4), quick=False),
    Case("commit_kv", "commit_kv", "B=1 28 layers, 2x128, n=6, bf16", commit_kv(28, 2, 4096, 128, 6, torch.bfloat16)),
    Case("commit_kv", "commit_kv", "B=4 28 layers, 2x128, n=16, bf16",
         commit_kv(28, 2, 4096, 128, 16, torch.bfloat16, rows=4), quick=False),
    Case("tree_attention", "tree_attention", "B=1 T=16 prefix=1024 12:2 d128 bf16",
         tree_attention(16, 1024, torch.bfloat16)),
    Case("tree_attention", "tree_attention", "B=1 T=64 prefix=4096 12:2 d128 bf16",
         tree_attention(64, 4096, torch.bfloat16), quick=False),
    Case("tree_attention", "tree_attention", "B=1 T=1 prefix=4096 12:2 d128 bf16",
         tree_attention(1, 4096, torch.bfloat16), quick=False),
    Case("tree_attention", "tree_attention", "B=4 T=16 prefix<=1024 ragged 12:2 d128 bf16",
         tree_attention(16, 1024, torch.bfloat16, rows=4), quick=False),
    Case("prompt_lookup", "prompt_lookup", "B=1 context 256, n-gram 3..1, L=10", prompt_lookup(256)),
    Case("prompt_lookup", "prompt_lookup", "B=4 context 4096, n-gram 3..1, L=10", prompt_lookup(4096, rows=4),
         quick=False),
    Case("quant_matmul", "quant_matmul", "int4 M=1 qkv 1536->2048 +bias bf16",
         quant_matmul(1, 2048, 1536, "int4", torch.bfloat16, bias=True)),
    Case("quant_matmul", "quant_matmul", "int8 M=1 qkv 1536->2048 +bias bf16",
         quant_matmul(1, 2048, 1536, "int8", torch.bfloat16, bias=True), quick=False),
    Case("quant_matmul", "quant_matmul", "int4 M=1 gate/up 1536->2x8960 bf16",
         quant_matmul(1, 17920, 1536, "int4", torch.bfloat16), quick=False),
    Case("quant_matmul", "quant_matmul", "int4 M=16 gate/up 1536->2x8960 bf16",
         quant_matmul(16, 17920, 1536, "int4", torch.bfloat16), quick=False),
    Case("quant_matmul", "quant_matmul", "int8 M=1 down 8960->1536 bf16",
         quant_matmul(1, 1536, 8960, "int8", torch.bfloat16), quick=False),
]


def implementation(case: Case, backend: str):
    """The reference op ("torch") or the Triton kernel ("triton") of a case."""
    import importlib
    package = "graft_tk.kernels" if backend == "triton" else "graft_tk.reference"
    return getattr(importlib.import_module(f"{package}.{case.op}"), case.fn)
