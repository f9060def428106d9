"""Graft: merge retrieved candidates into the drafted tree, up to the verification budget N.

The drafted tree keeps its nodes (they were ranked by drafter score); retrieval fills the
budget that dynamic-depth pruning freed. Worked example (budget_n = 5)::

    draft            tokens [r, a, b]  parents [-1, 0, 0]           (2 drafted nodes)
    template         parents [-1, -1, 0, 1]   retrieved [a, c, x, y]
    merge, BFS order: a  -> (root, a) exists: reuse node 1, no budget spent
                      c  -> new node 3 under the root
                      x  -> template parent mapped to node 1: new node 4 under a (chain grafted
                            beneath a drafted node)
                      y  -> budget full (5 nodes): dropped
    result           tokens [r, a, b, c, x]  parents [-1, 0, 0, 0, 1]
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..tree import RETRIEVAL, Tree
from .retrieval import RetrievalTemplate


def freed_budget(n_drafted_nodes: int | Tensor, budget_n: int) -> int | Tensor:
    """Budget left for retrieval: ``(budget_n - 1) - n_drafted_nodes``.

    n_drafted_nodes counts the kept drafted nodes *excluding* the root (the root is always
    verified and is not part of the drafter's choice). An int is checked; a tensor (the
    engine's on-device count) is not, to avoid a host sync.
    """
    if isinstance(n_drafted_nodes, int) and not 0 <= n_drafted_nodes <= budget_n - 1:
        raise ValueError(f"n_drafted_nodes must be in [0, budget_n - 1 = {budget_n - 1}], got {n_drafted_nodes}")
    return (budget_n - 1) - n_drafted_nodes


def graft_merge(draft: Tree, retrieved_tokens: Tensor, template: RetrievalTemplate, budget_n: int,
                source: int = RETRIEVAL) -> Tree:
    """Graft retrieved template nodes onto ``draft`` until the tree has ``budget_n`` nodes.

    Parameters
    ----------
    draft : Tree
        Root + the kept drafted nodes (parents before children), ``draft.n <= budget_n``.
    retrieved_tokens : Tensor, int64 [T]
        ``retrieve(adj, root, template)``: token of each template node, -1 = missing.
    template : RetrievalTemplate
        The T-node template ``retrieved_tokens`` was walked along (BFS order).
    budget_n : int
        Verification budget N (nodes in the tree, root included), >= 1.
    source : int
        Source code given to the new nodes (RETRIEVAL; PROMPT_LOOKUP for a prompt-lookup chain,
        which is a template whose every node takes rank 0 under the previous one).

    Returns
    -------
    Tree
        The drafted nodes unchanged at indices ``0 .. draft.n - 1``, then the new retrieved
        nodes (source ``source``, score -inf) in template order. Exactly
        ``min(budget_n, distinct candidates)`` nodes, parents before children.

    Notes
    -----
    Template nodes are visited in BFS order, so a template parent is resolved before its
    children: a node is dropped when its token is -1 or its template parent was dropped; when
    (tree parent, token) already exists (drafted, or added earlier) it maps onto that node at
    no cost, so a retrieved chain continues beneath a drafted node; otherwise it becomes a new
    node while the tree has fewer than ``budget_n`` nodes. This is the CPU reference: one
    device-to-host copy of the inputs, then O(N + T) dict operations (T = 80 for the default
    template) and one host-to-device copy of the result; the Triton kernel does it on device.
    """
    if not isinstance(budget_n, int) or budget_n < 1:
        raise ValueError(f"budget_n must be an int >= 1, got {budget_n!r}")
    if draft.n > budget_n:
        raise ValueError(f"the drafted tree has {draft.n} nodes, more than budget_n = {budget_n}")
    if retrieved_tokens.shape != (template.n,):
        raise ValueError(f"retrieved_tokens must be [T={template.n}], got {list(retrieved_tokens.shape)}")

    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    depth = draft.depth.tolist()
    node_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i > 0}
    mapped: list[int] = []  # template node -> tree node, -1 = dropped
    for tok, tpar in zip(retrieved_tokens.tolist(), template.parents.tolist()):
        parent = 0 if tpar < 0 else mapped[tpar]
        if tok < 0 or parent < 0:
            mapped.append(-1)
            continue
        node = node_of.get((parent, tok), -1)
        if node < 0 and len(tokens) < budget_n:
            node = len(tokens)
            node_of[(parent, tok)] = node
            tokens.append(tok)
            parents.append(parent)
            depth.append(depth[parent] + 1)
        mapped.append(node)

    n_new = len(tokens) - draft.n
    dev = draft.tokens.device
    return Tree(
        tokens=torch.tensor(tokens, dtype=torch.int64, device=dev),
        parents=torch.tensor(parents, dtype=torch.int32, device=dev),
        depth=torch.tensor(depth, dtype=torch.int32, device=dev),
        source=torch.cat([draft.source, torch.full((n_new,), source, dtype=torch.int8, device=dev)]),
        scores=torch.cat([draft.scores, torch.full((n_new,), float("-inf"), dtype=torch.float32, device=dev)]),
    )
