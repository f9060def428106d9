"""graft_merge reference: dedup against the draft, dropped subtrees, budget fill."""
import pytest
import torch

from graft_tk.adjacency import RetrievalTemplate, default_template
from graft_tk.reference.build_tree import freed_budget, graft_merge
from graft_tk.reference.retrieve import retrieve
from graft_tk.tree import DRAFT, RETRIEVAL, ROOT, Tree

R, A, B, C, X, Y, Z = 100, 1, 2, 3, 4, 5, 6


def draft_tree():
    """root r with drafted children a, b (scores -0.1, -0.5)."""
    return Tree.from_lists([R, A, B], [-1, 0, 0], source=[ROOT, DRAFT, DRAFT], scores=[0.0, -0.1, -0.5])


# root -> t0, t1; t0 -> t2; t1 -> t3; t2 -> t4
TEMPLATE = RetrievalTemplate(torch.tensor([-1, -1, 0, 1, 2]), torch.tensor([0, 1, 0, 0, 0]), k=2)


def merge(retrieved, budget_n, draft=None):
    tree = graft_merge(draft if draft is not None else draft_tree(), torch.tensor(retrieved), TEMPLATE, budget_n)
    tree.validate()
    return tree


def assert_tree(tree, tokens, parents, source):
    assert torch.equal(tree.tokens, torch.tensor(tokens))
    assert torch.equal(tree.parents, torch.tensor(parents, dtype=torch.int32))
    assert torch.equal(tree.source, torch.tensor(source, dtype=torch.int8))


def test_dedup_continues_beneath_drafted_node():
    # t0 = a equals drafted node 1: reused at no cost, so its chain x -> y hangs under node 1.
    tree = merge([A, C, X, Z, Y], budget_n=7)
    assert_tree(tree, [R, A, B, C, X, Z, Y], [-1, 0, 0, 0, 1, 3, 4],
                [ROOT, DRAFT, DRAFT, RETRIEVAL, RETRIEVAL, RETRIEVAL, RETRIEVAL])
    assert torch.equal(tree.depth, torch.tensor([0, 1, 1, 1, 2, 2, 3], dtype=torch.int32))
    assert torch.equal(tree.scores[:3], torch.tensor([0.0, -0.1, -0.5]))
    assert torch.isneginf(tree.scores[3:]).all()


def test_dedup_among_retrieved_nodes():
    # t0 = t1 = c: the second maps onto the first, so t3 (child of t1) lands under the same node.
    tree = merge([C, C, X, Y, Z], budget_n=10)
    assert_tree(tree, [R, A, B, C, X, Y, Z], [-1, 0, 0, 0, 3, 3, 4], [ROOT, DRAFT, DRAFT] + [RETRIEVAL] * 4)


def test_dropped_parent_drops_children():
    # t0 = -1: t2 and its child t4 are dropped even though their tokens are valid.
    tree = merge([-1, C, X, Y, Z], budget_n=10)
    assert_tree(tree, [R, A, B, C, Y], [-1, 0, 0, 0, 3], [ROOT, DRAFT, DRAFT, RETRIEVAL, RETRIEVAL])


def test_budget_exactly_filled():
    # 5 distinct candidates, budget 5: two retrieved nodes added (t0, t1), the rest dropped,
    # including t4 whose parent t2 did not fit.
    tree = merge([C, X, Y, Z, A], budget_n=5)
    assert tree.n == 5
    assert_tree(tree, [R, A, B, C, X], [-1, 0, 0, 0, 0], [ROOT, DRAFT, DRAFT, RETRIEVAL, RETRIEVAL])


def test_fewer_candidates_than_budget():
    tree = merge([C, -1, -1, -1, -1], budget_n=8)
    assert tree.n == 4
    assert_tree(tree, [R, A, B, C], [-1, 0, 0, 0], [ROOT, DRAFT, DRAFT, RETRIEVAL])


def test_budget_one_is_root_only():
    tree = merge([C, X, Y, Z, A], budget_n=1, draft=Tree.root(R))
    assert tree.n == 1 and torch.equal(tree.tokens, torch.tensor([R]))


def test_all_missing_leaves_draft_unchanged():
    draft = draft_tree()
    tree = merge([-1] * 5, budget_n=8, draft=draft)
    for name in ("tokens", "parents", "depth", "source", "scores"):
        assert torch.equal(getattr(tree, name), getattr(draft, name)), name


def test_full_draft_gets_nothing_but_reuse():
    tree = merge([A, C, X, Y, Z], budget_n=3)
    assert_tree(tree, [R, A, B], [-1, 0, 0], [ROOT, DRAFT, DRAFT])


def test_default_template_fills_budget_and_validates():
    # A dense random M: 80 candidates, so any budget up to ~80 is filled exactly.
    adj = torch.randint(0, 50, (50, 8), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    t = default_template()
    retrieved = retrieve(adj, torch.tensor(R % 50), t)
    draft = Tree.from_lists([R % 50, int(adj[R % 50, 0]), 7], [-1, 0, 1])
    for budget_n in (3, 16, 40):
        tree = graft_merge(draft, retrieved, t, budget_n)
        tree.validate()
        assert tree.n == budget_n


def test_bad_arguments():
    with pytest.raises(ValueError, match="more than budget_n"):
        graft_merge(draft_tree(), torch.full((5,), -1), TEMPLATE, 2)
    with pytest.raises(ValueError, match=r"retrieved_tokens must be \[T=5\]"):
        graft_merge(draft_tree(), torch.full((4,), -1), TEMPLATE, 8)


def test_freed_budget():
    assert freed_budget(2, 8) == 5
    assert freed_budget(0, 1) == 0
    assert torch.equal(freed_budget(torch.tensor(3), 8), torch.tensor(4))
    with pytest.raises(ValueError, match="n_drafted_nodes"):
        freed_budget(8, 8)
