"""Helpers for kernel-vs-reference tests: seeded random inputs shared by every kernel test."""
from __future__ import annotations

import torch

import graft_tk.kernels  # noqa: F401  (sets TRITON_INTERPRET before any kernel module is imported)
from graft_tk.tree import DRAFT, PROMPT_LOOKUP, RETRIEVAL, ROOT, Tree

# Kernel tests run on CUDA when there is one (compiled Triton), else on CPU (Triton's interpreter).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(*values):
    """Move inputs built on CPU (seeded CPU generators: the same values on every machine) to DEVICE;
    non-tensors (ints, floats) pass unchanged. One value gives one value, several a tuple."""
    moved = tuple(v.to(DEVICE) if isinstance(v, torch.Tensor) else v for v in values)
    return moved[0] if len(moved) == 1 else moved


def random_tree(n: int, seed: int, vocab: int = 50, max_children: int | None = None,
                device: torch.device | str = "cpu") -> Tree:
    """A valid random tree of ``n`` nodes: parents before children, distinct tokens among siblings,
    random sources and drafter scores (-inf for non-drafted nodes). Drawn on CPU whatever ``device``."""
    g = torch.Generator().manual_seed(seed)
    tokens, parents, sources, scores = [int(torch.randint(vocab, (1,), generator=g))], [-1], [ROOT], [0.0]
    children: dict[int, set[int]] = {0: set()}
    while len(tokens) < n:
        open_nodes = [i for i in range(len(tokens)) if max_children is None or len(children[i]) < max_children]
        p = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=g))]
        free = [t for t in range(vocab) if t not in children[p]]
        if not free:
            continue
        t = free[int(torch.randint(len(free), (1,), generator=g))]
        children[p].add(t)
        children[len(tokens)] = set()
        tokens.append(t)
        parents.append(p)
        s = [DRAFT, RETRIEVAL, PROMPT_LOOKUP][int(torch.randint(3, (1,), generator=g))]
        sources.append(s)
        scores.append(-float(torch.rand((), generator=g)) * 5 if s == DRAFT else float("-inf"))
    return Tree.from_lists(tokens, parents, sources, scores, device=device)


def counted():
    """``with counted() as c:`` counts the launches (and host reads) of the block in ``c``."""
    from graft_tk.counters import StepCounters, counting
    return counting(StepCounters())
