"""Micro-benchmarks of each op of a decode step: the torch reference, and the Triton kernel on CUDA.

    python -m pytest bench/test_bench_ops.py --benchmark-only [--benchmark-json out.json]

Sizes are those of a real step at the default config: budget N = 16, top-K = 4, the 80-node
retrieval template with k = 8, and the vocabularies of SmolLM2 (49,152) and Qwen2.5 (151,936).
A Triton variant runs when CUDA is present and ``graft_tk.kernels.<module>`` provides the op
(same name and signature as the reference); otherwise it is skipped with the reason.
"""
import importlib
import math

import pytest
import torch

from graft_tk.reference.retrieval import default_template, new_adjacency, retrieve
from graft_tk.tree import Tree

VOCABS = [pytest.param(49152, id="V49k"), pytest.param(151936, id="V152k")]
BACKENDS = ["torch", "triton"]
N, K = 16, 4


def op(module: str, name: str, backend: str):
    """The reference op, or its Triton launcher (skipping when there is none or no CUDA)."""
    if backend == "torch":
        return getattr(importlib.import_module(f"graft_tk.reference.{module}"), name)
    if not torch.cuda.is_available():
        pytest.skip("Triton kernels are benchmarked on CUDA only")
    try:
        fn = getattr(importlib.import_module(f"graft_tk.kernels.{module}"), name, None)
    except ImportError:
        fn = None
    if fn is None:
        pytest.skip(f"no Triton kernel graft_tk.kernels.{module}.{name} yet")
    return fn


def timed(benchmark, device, fn, *args):
    """Benchmark ``fn(*args)``; on CUDA wait for the kernels, or only the launch would be timed."""
    def call():
        out = fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out
    return benchmark(call)


def branchy_tree(n: int, device) -> Tree:
    """n nodes, two children per node (a balanced binary tree): the mask has depth log2(n)."""
    return Tree.from_lists(list(range(100, 100 + n)), [-1] + [(i - 1) // 2 for i in range(1, n)], device=device)


def filled_adjacency(vocab: int, device) -> torch.Tensor:
    """A fully written M, so retrieval walks every template node (the worst case)."""
    g = torch.Generator().manual_seed(0)
    adj = new_adjacency(vocab, 8)
    adj.copy_(torch.randint(0, vocab, adj.shape, generator=g, dtype=torch.int32))
    return adj.to(device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("frontier", [1, K], ids=["root", "frontier4"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_draft_expand(benchmark, device, backend, frontier, vocab):
    fn = op("draft_expand", "draft_expand", backend)
    logits = torch.randn(frontier, vocab, device=device)
    scores = torch.zeros(frontier, device=device)
    benchmark.extra_info.update(op="draft_expand", frontier=frontier, vocab=vocab, top_k=K)
    timed(benchmark, device, fn, scores, logits, K, math.log(0.1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_retrieve(benchmark, device, backend, vocab):
    fn = op("retrieval", "retrieve", backend)
    adj, template = filled_adjacency(vocab, device), default_template(8).to(device)
    benchmark.extra_info.update(op="retrieve", vocab=vocab, template_nodes=template.n)
    timed(benchmark, device, fn, adj, torch.tensor(7, device=device), template)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_update_adjacency(benchmark, device, backend, vocab):
    fn = op("retrieval", "update_adjacency", backend)
    adj = new_adjacency(vocab, 8, device)
    tokens = torch.randint(0, vocab, (N,), device=device)
    logits = torch.randn(N, vocab, device=device)
    benchmark.extra_info.update(op="update_adjacency", vocab=vocab, nodes=N)
    timed(benchmark, device, fn, adj, tokens, logits, torch.arange(N, device=device))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("drafted", [0, 7], ids=["retrieval_only", "half_drafted"])
def test_graft_merge(benchmark, device, backend, drafted):
    fn = op("graft_merge", "graft_merge", backend)
    vocab = 49152
    template = default_template(8).to(device)
    candidates = retrieve(filled_adjacency(vocab, device), torch.tensor(7, device=device), template)
    draft = branchy_tree(drafted + 1, device)
    benchmark.extra_info.update(op="graft_merge", drafted=drafted, budget=N, template_nodes=template.n)
    timed(benchmark, device, fn, draft, candidates, template, N)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_greedy_accept(benchmark, device, backend, vocab):
    fn = op("accept", "greedy_accept", backend)
    tree = branchy_tree(N, device)
    logits = torch.randn(N, vocab, device=device)
    benchmark.extra_info.update(op="greedy_accept", vocab=vocab, nodes=N)
    timed(benchmark, device, fn, tree, logits)


@pytest.mark.parametrize("nodes", [16, 64])
def test_tree_attn_mask(benchmark, device, nodes):
    tree = branchy_tree(nodes, device)
    benchmark.extra_info.update(op="tree.attn_mask", nodes=nodes)
    timed(benchmark, device, tree.attn_mask)


@pytest.mark.parametrize("prompt_tokens", [256, 2048])
def test_prompt_lookup(benchmark, device, prompt_tokens):
    fn = op("prompt_lookup", "prompt_lookup", "torch")
    g = torch.Generator().manual_seed(0)
    # a small alphabet repeats n-grams often, so lookups find matches as in code or summaries
    tokens = torch.randint(0, 64, (prompt_tokens,), generator=g).tolist()
    benchmark.extra_info.update(op="prompt_lookup", prompt_tokens=prompt_tokens)
    benchmark(fn, tokens)
