"""Tree: the docstring's worked example, the invariants validate() guards, and edge shapes."""
import pytest
import torch

from graft_tk.tree import DRAFT, RETRIEVAL, ROOT, Tree

# The 6-node example from graft_tk/tree.py's module docstring.
TOKENS = [100, 11, 12, 13, 14, 15]
PARENTS = [-1, 0, 0, 1, 1, 3]


@pytest.fixture
def example():
    return Tree.from_lists(TOKENS, PARENTS)


def test_worked_example_depth_and_defaults(example):
    assert example.n == 6
    assert torch.equal(example.depth, torch.tensor([0, 1, 1, 2, 2, 3], dtype=torch.int32))
    assert torch.equal(example.source, torch.tensor([ROOT] + [DRAFT] * 5, dtype=torch.int8))
    assert example.scores[0] == 0 and torch.isneginf(example.scores[1:]).all()


def test_worked_example_mask(example):
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 0, 1, 0, 0, 0],
                             [1, 1, 0, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0],
                             [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(example.attn_mask(), expected)


def test_worked_example_packed_mask(example):
    assert torch.equal(example.packed_mask(), torch.tensor([[1], [3], [5], [11], [19], [43]], dtype=torch.int32))


def test_worked_example_positions_and_leaf_paths(example):
    assert torch.equal(example.positions(7), torch.tensor([7, 8, 8, 9, 9, 10]))
    expected = torch.tensor([[0, 2, -1, -1], [0, 1, 4, -1], [0, 1, 3, 5]], dtype=torch.int32)
    assert torch.equal(example.leaf_paths(), expected)


def test_chain_mask_is_lower_triangular_and_packs_past_32():
    # 40 nodes: two words per row, and column 31 lands on the int32 sign bit.
    n = 40
    chain = Tree.from_lists(list(range(n)), [-1] + list(range(n - 1)))
    mask = chain.attn_mask()
    assert torch.equal(mask, torch.ones(n, n, dtype=torch.bool).tril())
    packed = chain.packed_mask()
    assert packed.shape == (n, 2) and packed.dtype == torch.int32
    unpacked = ((packed.long()[:, :, None] >> torch.arange(32)) & 1).reshape(n, 64)[:, :n].bool()
    assert torch.equal(unpacked, mask)
    assert packed[31, 0] == -1 and packed[31, 1] == 0  # bits 0..31 all set
    assert torch.equal(chain.leaf_paths(), torch.arange(n, dtype=torch.int32)[None])


def test_single_node_tree():
    root = Tree.root(torch.tensor(42))
    root.validate()
    assert root.n == 1
    assert torch.equal(root.attn_mask(), torch.ones(1, 1, dtype=torch.bool))
    assert torch.equal(root.packed_mask(), torch.ones(1, 1, dtype=torch.int32))
    assert torch.equal(root.positions(3), torch.tensor([3]))
    assert torch.equal(root.leaf_paths(), torch.zeros(1, 1, dtype=torch.int32))


@pytest.mark.parametrize("tokens, parents, source, match", [
    ([1, 2, 3], [-1, 2, 0], None, "node 1 has parent 2; parents must precede"),   # parent after child
    ([1, 2, 2], [-1, 0, 0], None, "nodes 1 and 2 are both children of node 0"),    # duplicate (parent, token)
    ([1, 2], [0, 0], None, "root .* must have parent -1"),                          # bad root
    ([1, 2], [-1, 0], [DRAFT, DRAFT], "root .* must have source ROOT"),
    ([1, -1], [-1, 0], None, "node 1 has token -1"),
    ([1, 2], [-1, 0], [ROOT, ROOT], "non-root nodes need"),
])
def test_validate_rejects(tokens, parents, source, match):
    with pytest.raises(ValueError, match=match):
        Tree.from_lists(tokens, parents, source=source)


def test_validate_rejects_bad_depth_and_dtype(example):
    bad_depth = Tree(example.tokens, example.parents, torch.tensor([0, 1, 1, 2, 2, 2], dtype=torch.int32),
                     example.source, example.scores)
    with pytest.raises(ValueError, match="node 5 has depth 2 but its parent 3 has depth 2"):
        bad_depth.validate()
    bad_dtype = Tree(example.tokens, example.parents.long(), example.depth, example.source, example.scores)
    with pytest.raises(ValueError, match="parents must be torch.int32"):
        bad_dtype.validate()
    bad_shape = Tree(example.tokens, example.parents, example.depth, example.source[:5], example.scores)
    with pytest.raises(ValueError, match=r"source must have shape \[N=6\]"):
        bad_shape.validate()


def test_same_token_under_different_parents_is_fine():
    Tree.from_lists([1, 5, 5, 5], [-1, 0, 1, 2], source=[ROOT, DRAFT, RETRIEVAL, RETRIEVAL])
