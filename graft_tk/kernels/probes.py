"""Seeded inputs for every op, the same on every machine: what the self-check
(``graft_tk.kernels.selfcheck``) runs each kernel on at small shapes, and what the op benchmarks
(``bench/cases.py``) time at real decode shapes.

Each function takes the shape and returns ``build(device) -> args``: the op's arguments, made
from seeded CPU generators, then moved (fresh on every call: some ops write in place).
"""
from __future__ import annotations

import math

import torch

from ..adjacency import default_template, new_adjacency
from ..reference.retrieve import retrieve as reference_retrieve
from ..tree import PROMPT_LOOKUP, RETRIEVAL, Tree

K = 4        # children per drafted node


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def branchy_tree(n: int, device) -> Tree:
    """n nodes, two children per node (a balanced binary tree)."""
    return Tree.from_lists(list(range(100, 100 + n)), [-1] + [(i - 1) // 2 for i in range(1, n)], device=device)


def filled_adjacency(vocab: int, device, k: int = 8) -> torch.Tensor:
    """A fully written M, so retrieval walks every template node (the worst case)."""
    adj = new_adjacency(vocab, k)
    adj.copy_(torch.randint(0, vocab, adj.shape, generator=seeded(), dtype=torch.int32))
    return adj.to(device)


def draft_expand(frontier: int, vocab: int, rows: int = 1):
    def build(device):
        logits = torch.randn(rows, frontier, vocab, generator=seeded()).to(device)
        scores = (-torch.rand(rows, frontier, generator=seeded(1))).to(device) if frontier > 1 else \
            torch.zeros(rows, 1, device=device)
        return scores, logits, K, torch.full((rows,), math.log(0.1), device=device)
    return build


def retrieve(vocab: int, rows: int = 1):
    def build(device):
        return filled_adjacency(vocab, device), torch.arange(7, 7 + rows, device=device), default_template(8).to(device)
    return build


def build_tree(budget: int, vocab: int, depth: int = 6, rows: int = 1):
    def build(device):
        P = K + (depth - 1) * K * K
        g = seeded()
        tokens = torch.randint(vocab, (rows, P), generator=g)
        parents = torch.cat([torch.full((K,), -1), torch.arange(P - K) // K]).long()   # K children per node
        depths = torch.zeros(P, dtype=torch.long)
        for i in range(P):
            depths[i] = 1 if parents[i] < 0 else depths[parents[i]] + 1
        scores = -depths.float() - torch.rand(rows, P, generator=g)                   # deeper = lower
        template = default_template(8)
        roots = torch.arange(7, 7 + rows)
        cand = reference_retrieve(filled_adjacency(vocab, "cpu"), roots, template)
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


def accept(nodes: int, vocab: int, rows: int = 1):
    """``rows`` copies of a balanced tree, logits per node; the choice is the argmax (the walk's cost
    does not depend on how it was chosen) and M is updated."""
    def build(device):
        tree = branchy_tree(nodes, device)
        logits = torch.randn(rows, nodes, vocab, generator=seeded()).to(device) * 3
        expand = lambda t: t[None].expand(rows, *t.shape).contiguous()  # noqa: E731
        return (expand(tree.tokens), expand(tree.parents), expand(tree.depth), expand(tree.packed_mask()),
                logits.argmax(-1), logits, new_adjacency(vocab, 8, device))
    return build


def commit_kv(layers: int, heads: int, slots: int, head_dim: int, n: int, dtype, rows: int = 1):
    def build(device):
        kv = torch.randn(layers, 2, rows, heads, slots, head_dim, generator=seeded()).to(dtype).to(device)
        start = slots - 64
        src = start + torch.arange(n) * 2                 # every other tree slot: an overlapping move
        return kv, src.expand(rows, -1).contiguous().to(device), torch.full((rows,), start, device=device)
    return build


def tree_attention(T: int, prefix: int, dtype, hq: int = 12, hkv: int = 2, d: int = 128, rows: int = 1):
    """``rows`` trees over prefixes of ``prefix`` keys and shorter (a ragged batch)."""
    def build(device):
        g = seeded()
        q = torch.randn(rows, hq, T, d, generator=g).to(dtype).to(device)
        k = torch.randn(rows, hkv, prefix + T, d, generator=g).to(dtype).to(device)
        v = torch.randn(rows, hkv, prefix + T, d, generator=g).to(dtype).to(device)
        block = branchy_tree(T, "cpu").attn_mask()[None].expand(rows, -1, -1).contiguous().to(device)
        prefixes = torch.tensor([prefix - i * prefix // (2 * rows) for i in range(rows)], device=device)
        return q, k, v, prefixes, block, prefix + T
    return build


def prompt_lookup(committed: int, spare: int = 128, rows: int = 1):
    def build(device):
        # a small alphabet repeats n-grams often, so lookups find matches as in code or summaries
        context = torch.cat([torch.randint(0, 64, (rows, committed), generator=seeded()),
                             torch.full((rows, spare), -1)], 1)
        return context.to(device), torch.full((rows,), committed).to(device), 3, 1, 10
    return build


def quant_matmul(M: int, N: int, K: int, mode: str, dtype, bias: bool = False):
    """x [M, K] times an int8 / int4 weight [N, K] (random integers, scales around 0.01)."""
    def build(device):
        g = seeded()
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
