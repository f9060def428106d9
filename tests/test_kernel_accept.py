"""Fused acceptance + successor-matrix update over a batch of trees: Triton kernel vs the torch reference.

The op walks each row's tree from the root along the target's choices (argmax, or the seeded
draw of ``graft_tk.sampling.choose``) and writes M from every writing row's logits in the
documented order. Path, n_path and bonus are integers; M is top-k ranks: both must be identical.
Ties: top-k takes the lowest index on ties in the kernel; torch.topk on CPU orders tied values
arbitrarily, so outside the tie test every logits row is continuous random (no ties) and the tie
test checks M against the stable-sort rule.

Inputs are drawn on CPU with seeded generators (the same values on every machine) and moved to
DEVICE (CUDA: compiled kernels; CPU: Triton's interpreter); kernel and reference share them.
"""
import pytest
import torch

from graft_tk.adjacency import new_adjacency
from graft_tk.kernels.accept import accept as accept_kernel
from graft_tk.reference.accept import accept, greedy_accept
from graft_tk.sampling import Sampling, choose
from graft_tk.tree import Tree, pack_mask
from tests.kernel_utils import DEVICE, counted, on_device, random_tree


def steered_logits(tree: Tree, vocab: int, seed: int, boost: float = 6.0) -> torch.Tensor:
    """Random logits (no ties) where one random child of each node gets +boost and its siblings
    up to +boost/2, so greedy and sampled paths run deep but not always to a leaf. CPU."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tree.n, vocab, generator=g)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    for node in range(tree.n):
        kids = [i for i in range(1, tree.n) if parents[i] == node]
        if kids:
            favourite = kids[int(torch.randint(len(kids), (1,), generator=g))]
            for c in kids:
                logits[node, tokens[c]] += boost if c == favourite else boost / 2 * float(torch.rand((), generator=g))
    return logits


def batch_of(trees: list[Tree], logits: list[torch.Tensor], N: int | None = None):
    """Rows padded to N nodes as ``BuiltTree`` pads them (token -1, parent -1, depth 0, own mask
    bit, logits of zeros): (tokens, parents, depth, mask, logits [B, N, V]) on DEVICE."""
    N = N or max(t.n for t in trees)
    V = logits[0].shape[1]
    rows = []
    for tree, lg in zip(trees, logits):
        n, pad = tree.n, N - tree.n
        anc = torch.eye(N, dtype=torch.bool)
        anc[:n, :n] = tree.attn_mask().cpu()
        rows.append((torch.cat([tree.tokens.cpu(), torch.full((pad,), -1)]),
                     torch.cat([tree.parents.cpu(), torch.full((pad,), -1, dtype=torch.int32)]),
                     torch.cat([tree.depth.cpu(), torch.zeros(pad, dtype=torch.int32)]),
                     pack_mask(anc), torch.cat([lg.cpu(), torch.zeros(pad, V)])))
    return tuple(on_device(torch.stack(field)) for field in zip(*rows))


def run_both(tokens, parents, depth, mask, choice, logits, k, writes=None, ties=False):
    """Kernel and reference on the same inputs; the kernel's launches (3 with M, whatever B).
    Returns the reference's outputs and the kernel's M (``ties``: torch.topk orders tied logits
    arbitrarily, so the reference's M is not compared)."""
    V = logits.shape[-1]
    adj_ref, adj_ker = new_adjacency(V, k, DEVICE), new_adjacency(V, k, DEVICE)
    ref = accept(tokens, parents, depth, mask, choice, logits, adj_ref, writes)
    with counted() as c:
        ker = accept_kernel(tokens, parents, depth, mask, choice, logits, adj_ker, writes)
    assert sum(c.launches.values()) == 3
    for name, r, o in zip(("path", "n_path", "bonus"), ref, ker):
        assert o.dtype == torch.int64 and o.shape == r.shape, (name, o.dtype, o.shape)
        assert torch.equal(o, r), (name, r, o)
    assert ties or torch.equal(adj_ker, adj_ref), ("adj", (adj_ker != adj_ref).nonzero()[:5])
    return ref, adj_ker


def sequential_writes(adj, trees, logits, paths, rows=None, tie_stable=False):
    """M written node by node in the documented order (rows in order; in a row, every node off the
    path by index, then the path root first): the definition of the last-writer rule."""
    k = adj.shape[1]
    for b, (tree, lg, path) in enumerate(zip(trees, logits, paths)):
        if rows is not None and not rows[b]:
            continue
        for i in [i for i in range(tree.n) if i not in path] + path:
            row = lg[i]
            top = torch.sort(row, descending=True, stable=True).indices[:k] if tie_stable else torch.topk(row, k).indices
            adj[tree.tokens[i]] = top.to(torch.int32).to(adj.device)
    return adj


def unpad(path, n_path):
    m = int(n_path)
    assert (path[m:] == -1).all()
    return path[:m].tolist()


# (N per row, vocab, k, max_children): the code paths each shape hits
SHAPES = [
    ((1, 1), 37, 3, None),        # roots only: no walk step, bonus at the root, one M row per row
    ((13, 9, 13), 37, 1, 3),      # N not a power of two (BLOCK_N 16), ragged rows padded, k = 1
    ((13, 13), 1100, 4, 2),       # V = 1024 + 76: two V chunks, the second partial; narrow deep trees
    ((30, 20, 30, 5), 50, 4, None),   # bushy trees, tokens repeat across branches and across rows
]


@pytest.mark.parametrize("sizes,vocab,k,max_children", SHAPES)
def test_greedy_matches_reference(sizes, vocab, k, max_children):
    trees = [random_tree(n, seed, vocab=min(vocab, 40), max_children=max_children) for seed, n in enumerate(sizes)]
    logits = [steered_logits(t, vocab, seed) for seed, t in enumerate(trees)]
    tokens, parents, depth, mask, lg = batch_of(trees, logits)
    (path, n_path, bonus), adj = run_both(tokens, parents, depth, mask, lg.argmax(-1), lg, k)
    # the fused reference equals the step-by-step definitions, row by row
    paths = []
    for b, tree in enumerate(trees):
        want, want_bonus = greedy_accept(tree, logits[b].argmax(-1))
        assert unpad(path[b], n_path[b]) == want and int(bonus[b]) == want_bonus
        paths.append(want)
    assert torch.equal(adj, sequential_writes(new_adjacency(vocab, k, DEVICE), trees, logits, paths))


@pytest.mark.parametrize("sizes,vocab,k,max_children", SHAPES)
def test_sampled_choices_match_reference(sizes, vocab, k, max_children):
    # Seeded draws (graft_tk.sampling.choose) instead of the argmax: the walk follows any choice.
    trees = [random_tree(n, 10 + seed, vocab=min(vocab, 40), max_children=max_children)
             for seed, n in enumerate(sizes)]
    logits = [steered_logits(t, vocab, seed) for seed, t in enumerate(trees)]
    tokens, parents, depth, mask, lg = batch_of(trees, logits)
    positions = 40 + depth.long() + 1
    choice = choose(lg, positions, [Sampling(0.9, 0.9, seed) for seed in range(len(trees))])
    (path, n_path, bonus), _ = run_both(tokens, parents, depth, mask, choice, lg, k)
    for b, tree in enumerate(trees):
        want, want_bonus = greedy_accept(tree, choice[b, :tree.n])
        assert unpad(path[b], n_path[b]) == want and int(bonus[b]) == want_bonus


def test_rows_that_do_not_read_m_do_not_write_it():
    trees = [random_tree(9, seed, vocab=12) for seed in range(3)]
    logits = [steered_logits(t, 64, seed) for seed, t in enumerate(trees)]
    tokens, parents, depth, mask, lg = batch_of(trees, logits)
    writes = on_device(torch.tensor([True, False, True]))
    (path, n_path, _), adj = run_both(tokens, parents, depth, mask, lg.argmax(-1), lg, 3, writes)
    paths = [unpad(path[b], n_path[b]) for b in range(3)]
    assert torch.equal(adj, sequential_writes(new_adjacency(64, 3, DEVICE), trees, logits, paths, [True, False, True]))


def test_ties_take_the_lowest_index():
    # Integer logits: every row is full of ties. The kernel's and the reference's M follow the
    # documented rule (value desc, index asc) = a stable descending sort.
    tree = Tree.from_lists([7, 2, 3, 4], [-1, 0, 1, 2])
    logits = torch.randint(0, 3, (4, 11), generator=torch.Generator().manual_seed(0)).float()
    logits[0] = torch.tensor([0, 1, 3, 0, 0, 3, 1, 0, 2, 2, 0.])      # argmax 2 (tied with 5): node 1 accepted
    logits[1] = torch.tensor([0, 1, 0, 3, 3, 0, 0, 0, 2, 2, 0.])      # argmax 3 (tied with 4): node 2
    logits[2] = torch.tensor([2, 0, 0, 1, 2, 1, 0, 0, 2, 0, 0.])      # argmax 0 (tied with 4, 8): stop
    tokens, parents, depth, mask, lg = batch_of([tree], [logits])
    (path, n_path, bonus), adj = run_both(tokens, parents, depth, mask, lg.argmax(-1), lg, 4, ties=True)
    assert unpad(path[0], n_path[0]) == [0, 1, 2] and int(bonus[0]) == 0
    assert torch.equal(adj, sequential_writes(new_adjacency(11, 4, DEVICE), [tree], [logits], [[0, 1, 2]],
                                              tie_stable=True))


def test_duplicate_tokens_last_writer_wins():
    # vocab 4 for 20 nodes per row: every token sits at several nodes of every row, on and off the path.
    trees = [random_tree(20, seed, vocab=4) for seed in range(3)]
    logits = [steered_logits(t, 64, seed) for seed, t in enumerate(trees)]
    tokens, parents, depth, mask, lg = batch_of(trees, logits)
    (path, n_path, _), adj = run_both(tokens, parents, depth, mask, lg.argmax(-1), lg, 3)
    paths = [unpad(path[b], n_path[b]) for b in range(3)]
    assert torch.equal(adj, sequential_writes(new_adjacency(64, 3, DEVICE), trees, logits, paths))
    assert (adj[4:] == -1).all()       # rows of tokens not in any tree are untouched


def test_no_adjacency_is_one_launch_and_changes_nothing_else():
    """Methods that never read M pass adj=None: the same paths and bonuses, nothing written."""
    trees = [random_tree(13, 3, vocab=40, max_children=3), random_tree(7, 4, vocab=40)]
    logits = [steered_logits(t, 1100, seed) for seed, t in enumerate(trees)]
    tokens, parents, depth, mask, lg = batch_of(trees, logits)
    with_m = accept(tokens, parents, depth, mask, lg.argmax(-1), lg, new_adjacency(1100, 4, DEVICE))
    for fn in (accept, accept_kernel):
        with counted() as c:
            got = fn(tokens, parents, depth, mask, lg.argmax(-1), None, None)
        for a, b in zip(got, with_m):
            assert torch.equal(a, b)
    assert sum(c.launches.values()) == 1


def test_bad_input_is_a_clear_error():
    trees = [random_tree(4, 0, vocab=10)]
    tokens, parents, depth, mask, lg = batch_of(trees, [torch.randn(4, 10)])
    choice = lg.argmax(-1)
    with pytest.raises(ValueError, match="must all be"):
        accept_kernel(tokens, parents, depth, mask, choice[:, :3], lg, new_adjacency(10, 2, DEVICE))
    with pytest.raises(ValueError, match="logits must be float32"):
        accept_kernel(tokens, parents, depth, mask, choice, lg.double(), new_adjacency(10, 2, DEVICE))
    with pytest.raises(ValueError, match="adj must be int32"):
        accept_kernel(tokens, parents, depth, mask, choice, lg, new_adjacency(11, 2, DEVICE))
