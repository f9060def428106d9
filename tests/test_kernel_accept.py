"""Fused acceptance + successor-matrix update: Triton kernel vs the torch reference.

Exactness: both sides quantize the target probabilities (from the same torch ``target_probs``)
and the uniforms elementwise and do every later step in int64, so path, n_path, bonus and M must
be identical on ANY input — these tests use arbitrary random logits and uniforms, not hand-picked
safe ones. Ties: argmax and top-k take the lowest index on ties in the kernel, and torch.argmax
does the same; torch.topk on CPU orders tied values arbitrarily, so outside the tie test every
logits row is continuous random (no ties) and the tie test checks M against the stable-sort rule.

Inputs are drawn on CPU with seeded generators (the same values on every machine) and moved to
DEVICE (CUDA: compiled kernels; CPU: Triton's interpreter); kernel and reference share them.
"""

import pytest
import torch

from tests.chi2 import chi2, chi2_critical
from tests.kernel_utils import DEVICE, on_device, random_tree
from graft_tk.backend import LAUNCHES
from graft_tk.kernels.accept import accept as accept_kernel
from graft_tk.reference.accept import accept, greedy_accept, quantize_probs, quantize_uniforms
from graft_tk.adjacency import new_adjacency
from graft_tk.sampling import target_probs, truncated_probs
from graft_tk.tree import Tree


def steered_logits(tree: Tree, vocab: int, seed: int, boost: float = 6.0) -> torch.Tensor:
    """Random logits (no ties) where one random child of each node gets +boost and its siblings
    up to +boost/2, so greedy and sampled paths run deep but not always to a leaf. Drawn on CPU,
    returned on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tree.n, vocab, generator=g)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    for node in range(tree.n):
        kids = [i for i in range(1, tree.n) if parents[i] == node]
        if kids:
            favourite = kids[int(torch.randint(len(kids), (1,), generator=g))]
            for c in kids:
                logits[node, tokens[c]] += boost if c == favourite else boost / 2 * float(torch.rand((), generator=g))
    return logits.to(DEVICE)


def path_last_order(n: int, path: list[int]) -> list[int]:
    """The engine's M write order: every node by index, the accepted path (root first) last."""
    return [i for i in range(n) if i not in path] + path


def sequential_writes(adj, tree, logits, path, tie_stable=False):
    """M written node by node in the engine's order: the definition of the last-writer rule."""
    k = adj.shape[1]
    for i in path_last_order(tree.n, path):
        row = logits[i]
        top = torch.sort(row, descending=True, stable=True).indices[:k] if tie_stable else torch.topk(row, k).indices
        adj[tree.tokens[i]] = top.to(torch.int32)
    return adj


def sequential_sample_accept(tree, logits, temperature, top_p, uniforms):
    """The integer sampling rule, walked node by node and child by child over every row's quantized
    nucleus (the renormalisation is the integer mass)."""
    q = quantize_probs(truncated_probs(logits, temperature, top_p)).tolist()
    u = quantize_uniforms(uniforms).tolist()
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    path, node = [0], 0
    while True:
        mass = sum(q[node])
        for c in [i for i in range(1, tree.n) if parents[i] == node]:   # index order
            if u[c] * mass < q[node][tokens[c]] << 24:
                break
            mass -= q[node][tokens[c]]
        else:
            residual = list(q[node])
            for c in [i for i in range(1, tree.n) if parents[i] == node]:
                residual[tokens[c]] = 0
            total, cum = sum(residual), 0
            for x, r in enumerate(residual):
                cum += r
                if cum << 24 > u[0] * total:
                    return path, x
            raise AssertionError("inverse CDF found no token")
        node = c
        path.append(node)


def run_both(tree, logits, k, temperature, top_p, uniforms):
    """Kernel and reference on the same inputs; asserts the kernel used two launches."""
    adj_ref, adj_ker = new_adjacency(logits.shape[1], k, DEVICE), new_adjacency(logits.shape[1], k, DEVICE)
    ref = accept(tree, logits, adj_ref, temperature, top_p, uniforms)
    before = LAUNCHES.count
    ker = accept_kernel(tree, logits, adj_ker, temperature, top_p, uniforms)
    assert LAUNCHES.count - before == 2
    return ref, ker, adj_ref, adj_ker


def assert_same(ref, ker, adj_ref, adj_ker, what):
    for name, r, o in zip(("path", "n_path", "bonus"), ref, ker):
        assert o.dtype == torch.int64 and o.shape == r.shape, (what, name, o.dtype, o.shape)
        assert torch.equal(o, r), (what, name, r, o)
    assert torch.equal(adj_ker, adj_ref), (what, "adj", (adj_ker != adj_ref).nonzero()[:5])


def unpad(path, n_path):
    m = int(n_path)
    assert (path[m:] == -1).all()
    return path[:m].tolist()


# (N, vocab, k, max_children): the code paths each shape hits
SHAPES = [
    (1, 37, 3, None),       # root only: no walk step, bonus at the root, one M row
    (13, 37, 1, 3),         # N not a power of two (BLOCK_N 16), k = 1, one V chunk of 64 (37 < 64)
    (13, 1100, 4, 2),       # V = 1024 + 76: two V chunks, the second partial; narrow deep tree
    (30, 50, 4, None),      # bushy tree, tokens repeat across branches (vocab 50 for 30 nodes)
]


@pytest.mark.parametrize("n,vocab,k,max_children", SHAPES)
def test_greedy_matches_reference(n, vocab, k, max_children):
    for seed in range(2):
        tree = random_tree(n, seed, vocab=min(vocab, 40), max_children=max_children)
        logits = steered_logits(tree, vocab, seed)
        ref, ker, adj_ref, adj_ker = run_both(tree, logits, k, 0.0, 1.0, None)
        assert_same(ref, ker, adj_ref, adj_ker, (n, vocab, k, seed))
        # the fused reference equals the step-by-step definitions
        path, bonus = greedy_accept(tree, logits)
        assert unpad(*ref[:2]) == path.tolist() and int(ref[2]) == int(bonus)
        expected = sequential_writes(new_adjacency(vocab, k, DEVICE), tree, logits, path.tolist())
        assert torch.equal(adj_ref, expected)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
@pytest.mark.parametrize("n,vocab,k,max_children", SHAPES)
def test_sampling_matches_reference(n, vocab, k, max_children, temperature, top_p):
    for seed in range(2):
        tree = random_tree(n, 10 + seed, vocab=min(vocab, 40), max_children=max_children)
        logits = steered_logits(tree, vocab, seed)
        uniforms = on_device(torch.rand(n, generator=torch.Generator().manual_seed(seed)))
        ref, ker, adj_ref, adj_ker = run_both(tree, logits, k, temperature, top_p, uniforms)
        assert_same(ref, ker, adj_ref, adj_ker, (n, vocab, k, seed, temperature, top_p))
        path, bonus = sequential_sample_accept(tree, logits, temperature, top_p, uniforms)
        assert unpad(*ref[:2]) == path and int(ref[2]) == bonus
        assert torch.equal(adj_ref, sequential_writes(new_adjacency(vocab, k, DEVICE), tree, logits, path))


def test_sampling_extreme_uniforms():
    # u = 0 accepts the first child with any mass; u = 1 - 2**-24 rejects every child that is not
    # certain and draws the residual's last token that has mass; u = 1.0 (outside [0, 1)) clamps.
    tree = random_tree(9, 3, vocab=20, max_children=3, device=DEVICE)
    logits = steered_logits(tree, 300, 3)
    for value in (0.0, 1.0 - 2 ** -24, 1.0):
        uniforms = torch.full((9,), value, device=DEVICE)
        ref, ker, adj_ref, adj_ker = run_both(tree, logits, 2, 1.0, 0.95, uniforms)
        assert_same(ref, ker, adj_ref, adj_ker, value)
        path, bonus = sequential_sample_accept(tree, logits, 1.0, 0.95, uniforms)
        assert unpad(*ref[:2]) == path and int(ref[2]) == bonus


def test_a_rejected_child_is_never_the_bonus():
    # Root with children carrying the 3 likeliest tokens: when all are rejected the bonus comes
    # from the rest (their mass is removed from the residual, inside the crossing V chunk).
    tree = Tree.from_lists([0, 1100, 1101, 1102], [-1, 0, 0, 0], device=DEVICE)
    logits = torch.randn(4, 1500, generator=torch.Generator().manual_seed(0))
    logits[0, 1100:1103] += 3.0
    logits = on_device(logits)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        uniforms = torch.rand(4, generator=g)
        uniforms[1:] = 0.999                       # reject all three children
        uniforms = on_device(uniforms)
        ref, ker, adj_ref, adj_ker = run_both(tree, logits, 2, 1.0, 1.0, uniforms)
        assert_same(ref, ker, adj_ref, adj_ker, uniforms)
        assert int(ker[1]) == 1 and int(ker[2]) not in (1100, 1101, 1102)


def test_ties_take_the_lowest_index():
    # Integer logits in [0, 3): every row is full of ties. Node 0's max is tied at tokens 2 and 5;
    # its child carries token 5, so greedy must NOT accept it (argmax = 2, the lowest index).
    tree = Tree.from_lists([7, 5, 2, 4], [-1, 0, 1, 2], device=DEVICE)
    logits = on_device(torch.randint(0, 3, (4, 11), generator=torch.Generator().manual_seed(0)).float())
    logits[0] = torch.tensor([0, 1, 3, 0, 0, 3, 1, 0, 2, 2, 0.], device=DEVICE)
    ref, ker, adj_ref, adj_ker = run_both(tree, logits, 4, 0.0, 1.0, None)
    for r, o in zip(ref, ker):
        assert torch.equal(r, o)
    assert unpad(*ker[:2]) == [0] and int(ker[2]) == 2
    # Chain agreeing through ties: node 1 (token 2) is now the tied lowest index and is accepted.
    tree = Tree.from_lists([7, 2, 3, 4], [-1, 0, 1, 2], device=DEVICE)
    logits[1] = torch.tensor([0, 1, 0, 3, 3, 0, 0, 0, 2, 2, 0.], device=DEVICE)   # argmax 3 (tied with 4)
    logits[2] = torch.tensor([2, 0, 0, 1, 2, 1, 0, 0, 2, 0, 0.], device=DEVICE)   # argmax 0 (tied with 4, 8): stop
    ref, ker, adj_ref, adj_ker = run_both(tree, logits, 4, 0.0, 1.0, None)
    for r, o in zip(ref, ker):
        assert torch.equal(r, o)
    assert unpad(*ker[:2]) == [0, 1, 2]
    # M: the kernel's documented rule (value desc, index asc) = a stable descending sort.
    expected = sequential_writes(new_adjacency(11, 4, DEVICE), tree, logits, [0, 1, 2], tie_stable=True)
    assert torch.equal(adj_ker, expected)


def test_duplicate_tokens_last_writer_wins():
    # vocab 4 for 20 nodes: every token sits at several nodes, on and off the path.
    for seed in range(3):
        tree = random_tree(20, seed, vocab=4, device=DEVICE)
        logits = steered_logits(tree, 64, seed)
        for temperature in (0.0, 1.0):
            uniforms = on_device(torch.rand(20, generator=torch.Generator().manual_seed(seed)))
            ref, ker, adj_ref, adj_ker = run_both(tree, logits, 3, temperature, 1.0, uniforms)
            assert_same(ref, ker, adj_ref, adj_ker, (seed, temperature))
            path = unpad(*ker[:2])
            assert torch.equal(adj_ker, sequential_writes(new_adjacency(64, 3, DEVICE), tree, logits, path))
            assert (adj_ker[4:] == -1).all()       # rows of tokens not in the tree are untouched


def test_default_uniforms_come_from_the_generator():
    tree = random_tree(7, 0, vocab=20, device=DEVICE)
    logits = steered_logits(tree, 40, 0)
    adj_a, adj_b = new_adjacency(40, 2, DEVICE), new_adjacency(40, 2, DEVICE)
    # Both draw the uniforms on the logits' device, so the generator lives there (a CUDA generator on
    # a GPU: other values than on CPU, but the same stream for kernel and reference).
    a = accept(tree, logits, adj_a, 1.0, 1.0, generator=torch.Generator(device=DEVICE).manual_seed(5))
    b = accept_kernel(tree, logits, adj_b, 1.0, 1.0, generator=torch.Generator(device=DEVICE).manual_seed(5))
    assert_same(a, b, adj_a, adj_b, "generator")


def test_bad_input_is_a_clear_error():
    tree = random_tree(4, 0, vocab=10, device=DEVICE)
    logits = torch.randn(4, 10, device=DEVICE)
    with pytest.raises(ValueError, match="logits must be float32"):
        accept_kernel(tree, logits[:3], new_adjacency(10, 2, DEVICE), 0.0, 1.0)
    with pytest.raises(ValueError, match="logits must be float32"):
        accept_kernel(tree, logits.double(), new_adjacency(10, 2, DEVICE), 0.0, 1.0)
    with pytest.raises(ValueError, match="adj must be int32"):
        accept_kernel(tree, logits, new_adjacency(11, 2, DEVICE), 0.0, 1.0)
    with pytest.raises(ValueError, match="uniforms must be"):
        accept_kernel(tree, logits, new_adjacency(10, 2, DEVICE), 1.0, 1.0, torch.rand(3, device=DEVICE))


# ---------------------------------------------------------------- the reference is lossless

@pytest.fixture
def one_thread():
    """5000 calls on [5, 6] tensors: with 2 OpenMP threads on a loaded 2-core machine one tiny
    torch.softmax was measured at 7.8 ms (fork/join waits on a descheduled thread) vs 5 us on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("top_p", [1.0, 0.85])
def test_reference_sampling_is_lossless(top_p, one_thread):
    """Root with 3 candidates (one with a child of its own), vocab 6, random uniforms: the first
    committed token ~ p_root and, after node 1 (token 2), the next ~ p_node1 (chi-square, p=0.001).

    CPU only on purpose: a statistical fact about the torch reference (no kernel runs), 5000 tiny
    calls that the one_thread fixture keeps fast on CPU; the device adds nothing to it."""
    g = torch.Generator().manual_seed(0)
    vocab = 6
    tree = Tree.from_lists([0, 2, 4, 1, 3], [-1, 0, 0, 0, 1])
    logits = torch.randn(5, vocab, generator=g) * 1.5
    adj = new_adjacency(vocab, 2)
    counts1, counts2 = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(5000):
        path, n_path, bonus = accept(tree, logits, adj, 1.0, top_p, torch.rand(5, generator=g))
        seq = tree.tokens[path[1:int(n_path)]].tolist() + [int(bonus)]
        counts1[seq[0]] += 1
        if seq[0] == 2:                 # node 1 accepted: the next token comes from node 1's p
            counts2[seq[1]] += 1
    for counts, node in ((counts1, 0), (counts2, 1)):
        stat, df = chi2(counts, target_probs(logits[node], 1.0, top_p))
        assert stat < chi2_critical(df), (node, stat, df)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 0.8)])
def test_no_adjacency_skips_the_update_and_changes_nothing_else(temperature, top_p):
    """Methods that never read M pass adj=None: same path and bonus, nothing written."""
    tree = random_tree(13, 3, vocab=40, max_children=3)
    logits = steered_logits(tree, 1100, 3)
    uniforms = torch.rand(13, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with_m = accept(tree, logits, new_adjacency(1100, 4, DEVICE), temperature, top_p, uniforms)
    for fn in (accept, accept_kernel):
        got = fn(tree, logits, None, temperature, top_p, uniforms)
        for a, b in zip(got, with_m):
            assert torch.equal(a, b)
