"""Micro-benchmarks of each op of a decode step: the torch reference, and the Triton kernel on CUDA.

    python -m pytest bench/test_bench_ops.py --benchmark-only [--benchmark-json out.json]

The cases (real step shapes) live in bench/cases.py, shared with bench/gpu_check.py. The Triton
variant runs on CUDA only: without it the kernels would run in Triton's interpreter, which says
nothing about speed.
"""
import pytest
import torch

from bench.cases import CASES, implementation
from graft_tk.kernels.probes import branchy_tree

BACKENDS = ["torch", "triton"]


def timed(benchmark, device, fn, *args):
    """Benchmark ``fn(*args)``; on CUDA wait for the kernels, or only the launch would be timed."""
    def call():
        out = fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out
    return benchmark(call)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[f"{c.fn}[{c.label}]" for c in CASES])
def test_op(benchmark, device, backend, case):
    if backend == "triton" and device.type != "cuda":
        pytest.skip("Triton kernels are benchmarked on CUDA only (the CPU interpreter says nothing about speed)")
    fn = implementation(case, backend)
    benchmark.extra_info.update(op=case.fn, shape=case.label, backend=backend)
    timed(benchmark, device, fn, *case.build(device))


@pytest.mark.parametrize("nodes", [16, 64])
def test_tree_attn_mask(benchmark, device, nodes):
    tree = branchy_tree(nodes, device)
    benchmark.extra_info.update(op="tree.attn_mask", nodes=nodes)
    timed(benchmark, device, tree.attn_mask)
