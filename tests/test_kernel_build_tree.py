"""build_tree: Triton kernel (compiled on CUDA, interpreted on CPU) vs torch reference, and the
reference vs the step-by-step pipeline (select_nodes + draft_as_tree + a plain-Python graft of
every candidate in order).

Pools come from the reference draft_expand on random logits over a few depths, exactly as
drafting.expand fills them; candidates are a prompt-lookup-like chain followed by reference retrieve
on a random adjacency. A small vocabulary (V = 12..24) makes drafted and retrieved tokens collide,
so the dedup paths run on every seed. Pools and candidates are built on CPU (seeded: the same
values everywhere) and moved to DEVICE; kernel and reference get the same device tensors.
"""
import math

import pytest
import torch

from graft_tk.adjacency import RetrievalTemplate, default_template, template_from_level_sizes
from graft_tk.kernels.build_tree import build_tree as build_tree_kernel
from graft_tk.reference.build_tree import FREE_FLOOR, build_tree, draft_as_tree, select_nodes
from graft_tk.reference.draft_expand import draft_expand
from graft_tk.reference.retrieve import retrieve
from graft_tk.tree import DRAFT, PROMPT_LOOKUP, RETRIEVAL, ROOT, BuiltTree, Tree, unpack_mask
from tests.kernel_utils import DEVICE, counted, on_device

FIELDS = ("tokens", "parents", "depth", "source", "scores", "pool_index", "mask", "n_nodes", "cand_node")


def make_pool(seed: int, vocab: int, top_k: int, max_depth: int, log_tau: float, garbage: bool = True):
    """drafting.expand's candidate pool on random logits: (tokens, parents, scores, depths, n). Entries
    past n are garbage with the best possible score when ``garbage`` (the op must ignore them).
    Built on CPU (the reference draft_expand on CPU-drawn logits): move with ``on_device``."""
    g = torch.Generator().manual_seed(seed)
    P = top_k + (max_depth - 1) * top_k * top_k
    tokens = torch.randint(vocab, (P,), generator=g) if garbage else torch.zeros(P, dtype=torch.long)
    parents = torch.full((P,), -1, dtype=torch.long)
    scores = torch.zeros(P) if garbage else torch.full((P,), -math.inf)
    depths = torch.zeros(P, dtype=torch.long)
    frontier, frontier_scores, n = None, torch.zeros(1), 0
    for depth in range(1, max_depth + 1):
        logits = torch.randn(frontier_scores.shape[0], vocab, generator=g) * 2.5
        tok, par, sc, nxt, stop = (x[0] if x.dim() and i != 1 else x for i, x in enumerate(
            draft_expand(frontier_scores[None], logits[None], top_k, torch.tensor([log_tau]))))
        m = tok.shape[0]
        tokens[n:n + m], scores[n:n + m], depths[n:n + m] = tok, sc, depth
        parents[n:n + m] = -1 if frontier is None else frontier[par]
        frontier, frontier_scores = n + nxt, sc[nxt]
        n += m
        if bool(stop):
            break
    return tokens, parents, scores, depths, n


def make_candidates(seed: int, vocab: int, root: int, chain: list[int], template: RetrievalTemplate,
                    k: int = 8, missing: float = 0.2):
    """A prompt-lookup chain (given tokens, -1 = missing) then the template walked over a random
    adjacency with ``missing`` of its entries empty: (tokens, parents int32, source int8), on CPU.
    ``template`` must be on CPU."""
    g = torch.Generator().manual_seed(seed)
    adj = torch.randint(vocab, (vocab, k), generator=g, dtype=torch.int32)
    adj[torch.rand(vocab, k, generator=g) < missing] = -1
    retrieved = retrieve(adj, torch.tensor([root]), template)[0]
    L = len(chain)
    tokens = torch.cat([torch.tensor(chain, dtype=torch.int64), retrieved])
    tpar = template.parents.long()
    parents = torch.cat([torch.arange(-1, L - 1), torch.where(tpar < 0, -1, tpar + L)]).to(torch.int32)
    source = torch.tensor([PROMPT_LOOKUP] * L + [RETRIEVAL] * template.n, dtype=torch.int8)
    return tokens, parents, source


def graft_in_order(tree: Tree, cand_tokens, cand_parents, cand_source, N) -> Tree:
    """The budget filled in candidate order, plain Python: a candidate is dropped when its token is
    -1 or its parent was; one whose (parent, token) exists maps onto that node; else it is a new
    node while the tree has fewer than N."""
    tokens, parents, source = tree.tokens.tolist(), tree.parents.tolist(), tree.source.tolist()
    scores = tree.scores.tolist()
    mapped = []
    for tok, tpar, src in zip(cand_tokens.tolist(), cand_parents.tolist(), cand_source.tolist()):
        parent = 0 if tpar < 0 else mapped[tpar]
        existing = [i for i in range(1, len(tokens)) if parents[i] == parent and tokens[i] == tok]
        if tok < 0 or parent < 0:
            mapped.append(-1)
        elif existing:
            mapped.append(existing[0])
        elif len(tokens) < N:
            mapped.append(len(tokens))
            tokens.append(tok), parents.append(parent), source.append(src), scores.append(-math.inf)
        else:
            mapped.append(-1)
    return Tree.from_lists(tokens, parents, source, scores, device=tree.tokens.device)


def old_pipeline(pool, root, log_tau, cand_tokens, cand_parents, cand_source, N) -> Tree:
    """Step by step: select + draft_as_tree, then every candidate grafted in order."""
    tokens, parents, scores, depths, n = pool
    keep = select_nodes(parents[:n], scores[:n], N - 1, log_tau)
    tree = draft_as_tree(tokens, parents, scores, depths, keep, root)
    return graft_in_order(tree, cand_tokens, cand_parents, cand_source, N)


def batched(args):
    """build_tree's single-tree arguments (pool [P], n_pool, root, log_tau as numbers, candidates
    [C], N, values) as a batch of two rows: the tree asked for, and a second with another root
    and its candidates rolled by one."""
    (tokens, parents, scores, depths, n, root, log_tau, cand, cpar, csrc, N, *values) = args
    n = torch.as_tensor(n, device=DEVICE).reshape(())
    root = torch.as_tensor(root, device=DEVICE).reshape(())
    two = lambda t, other: torch.stack([t, other])   # noqa: E731
    out = [two(tokens, tokens), two(parents, parents), two(scores, scores), two(depths, depths), two(n, n),
           two(root, root + 1), torch.tensor([log_tau, log_tau], dtype=torch.float32, device=DEVICE),
           two(cand, cand.roll(1) if cand.numel() else cand), cpar, csrc, N]
    for v in values:
        out.append(None if v is None else two(v, v.flip(0) if v.dim() and v.shape[0] == cand.shape[0] else v))
    return out


def run_both(*args):
    """Kernel and reference on the same arguments, batched with a second row (``batched``): every
    output equal, one launch for both rows, each row a valid tree. Returns the first row's tree."""
    args = batched(args)
    with counted() as c:
        got = build_tree_kernel(*args)
    assert sum(c.launches.values()) == 1
    want = build_tree(*args)
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.equal(g, w), f"{name}: kernel {g.tolist()} != reference {w.tolist()}"
    for b in range(2):
        check_tree(BuiltTree(*(field[b] for field in got)))
    return BuiltTree(*(field[0] for field in got))


def check_tree(out):
    """The valid prefix is a valid Tree whose masks are the op's mask; padding is inert."""
    n, N = int(out.n_nodes), out.tokens.shape[0]
    tree = Tree(out.tokens[:n], out.parents[:n], out.depth[:n], out.source[:n], out.scores[:n])
    tree.validate()
    assert torch.equal(out.mask[:n, :(n + 31) // 32], tree.packed_mask())
    assert torch.equal(unpack_mask(out.mask, N)[:n, :n], tree.attn_mask())
    assert not unpack_mask(out.mask, N)[:n, n:].any()                       # no real row sees padding
    assert torch.equal(unpack_mask(out.mask, N)[n:], torch.eye(N, dtype=torch.bool, device=out.mask.device)[n:])
    assert (out.tokens[n:] == -1).all() and (out.source[n:] == -1).all() and (out.pool_index[n:] == -1).all()
    drafted = tree.source == DRAFT
    assert ((out.pool_index[:n] >= 0) == drafted).all()
    return tree


def realistic_args(seed, N, log_tau, vocab=16, top_k=4, max_depth=4, chain_len=5, sizes=(8, 21, 25, 15, 8, 3)):
    """(build_tree args, old_pipeline args), every tensor on DEVICE (built on CPU, then moved)."""
    pool = make_pool(seed, vocab, top_k, max_depth, log_tau)
    tokens, parents, scores, depths, n = pool
    root = int(torch.randint(vocab, (1,), generator=torch.Generator().manual_seed(seed + 1000)))
    # The chain repeats the best drafted child, then new tokens (reuse, then a graft beneath it).
    chain = ([int(tokens[0])] + [(seed * 7 + i) % vocab for i in range(chain_len - 1)])[:chain_len]
    template = template_from_level_sizes(sizes, 8)
    cands = make_candidates(seed, vocab, root, chain, template)
    args = on_device(tokens, parents, scores, depths, n, torch.tensor(root), log_tau, *cands, N)
    return args, (on_device(*pool), root, log_tau, *args[7:10], N)


# ------------------------------------------------------------------ kernel vs reference, realistic
@pytest.mark.parametrize("N,log_tau", [
    (16, math.log(0.05)),      # the default budget: 8-14 drafted, the chain and the template fill it
    (24, math.log(0.1)),       # N not a power of two; 6-8 drafted, ~half the tree retrieved
    (40, math.log(0.1)),       # two mask words; one seed runs out of candidates (33 nodes)
    (64, math.log(0.2)),       # heavy pruning: mostly retrieval, budget never filled
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_realistic_matches_reference(seed, N, log_tau):
    run_both(*realistic_args(seed, N, log_tau)[0])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("N", [8, 16, 40])
def test_reference_equals_old_pipeline(seed, N):
    # The fused op's semantics are today's pipeline, exactly.
    args, old = realistic_args(seed, N, math.log(0.05))
    tree = check_tree(BuiltTree(*(field[0] for field in build_tree(*batched(args)))))
    ref = old_pipeline(*old)
    for name in ("tokens", "parents", "depth", "source", "scores"):
        assert torch.equal(getattr(tree, name), getattr(ref, name)), name


def test_n_pool_as_device_tensor():
    args, _ = realistic_args(5, 16, math.log(0.05))
    args = list(args)
    args[4] = torch.tensor(args[4], device=DEVICE)
    run_both(*args)


@pytest.mark.parametrize("n_pool", [1, 10])
def test_entries_past_n_pool_are_ignored(n_pool):
    # A prefix of the creation order is itself a pool (parents first). Entries past it get the
    # best possible score (0.0) and must not be selected; log_tau = -inf keeps the prefix eligible.
    args, _ = realistic_args(9, 16, -math.inf)
    args = list(args)
    args[2] = args[2].clone()
    args[2][n_pool:] = 0.0
    args[4] = n_pool
    out = run_both(*args)
    assert int((out.pool_index >= 0).sum()) == n_pool and (out.pool_index < n_pool).all()


# ------------------------------------------------------------------ edges
def test_budget_one_is_root_only():
    out = run_both(*realistic_args(0, 1, -math.inf)[0])
    assert int(out.n_nodes) == 1 and out.source.tolist() == [ROOT]


def test_empty_pool_retrieval_only():
    args, _ = realistic_args(1, 16, math.log(0.05))
    out = run_both(*args[:4], 0, *args[5:])
    assert (out.source[1:int(out.n_nodes)] != DRAFT).all()


def test_zero_sized_pool_and_no_candidates():
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    out = run_both(empty, empty, torch.zeros(0, device=DEVICE), empty, 0, torch.tensor(9, device=DEVICE), 0.0,
                   empty, *on_device(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int8)), 5)
    assert int(out.n_nodes) == 1 and out.tokens.tolist() == [9, -1, -1, -1, -1]


def test_no_candidates_is_the_pruned_draft():
    args, _ = realistic_args(2, 16, math.log(0.05))
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    no_parents, no_source = on_device(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int8))
    out = run_both(*args[:7], empty, no_parents, no_source, 16)
    assert (out.source[1:int(out.n_nodes)] == DRAFT).all()


def test_all_candidates_missing():
    args, _ = realistic_args(3, 16, math.log(0.05))
    out = run_both(*args[:7], torch.full_like(args[7], -1), *args[8:])
    assert (out.source[1:int(out.n_nodes)] == DRAFT).all()


def test_candidates_duplicating_drafted_nodes():
    # The chain walks the drafted tree's best path: every chain node is reused (no budget spent),
    # so nothing new has source PROMPT_LOOKUP; then a template whose nodes repeat the chain.
    pool = make_pool(4, 16, 4, 4, -math.inf)
    tokens, parents, scores, depths, n = pool
    path, node = [], 0                        # pool ids along the first-child path
    while node < n:
        path.append(node)
        kids = [i for i in range(n) if int(parents[i]) == node]
        node = kids[0] if kids else n
    chain = [int(tokens[i]) for i in path]
    L = len(chain)
    cand = torch.tensor(chain + chain, dtype=torch.int64)
    cpar = torch.cat([torch.arange(-1, L - 1), torch.arange(L - 1, 2 * L - 1)]).to(torch.int32)
    cpar[L] = -1
    csrc = torch.tensor([PROMPT_LOOKUP] * L + [RETRIEVAL] * L, dtype=torch.int8)
    out = run_both(*on_device(tokens, parents, scores, depths, n, torch.tensor(3), -math.inf, cand, cpar, csrc, 16))
    assert int(out.n_nodes) == 16 and (out.source[1:] == DRAFT).all()


def test_budget_exhausted_mid_template():
    # Few drafted nodes, a dense template: the budget fills at some template node; later nodes are
    # dropped unless they dedup onto existing nodes.
    args, _ = realistic_args(6, 20, math.log(0.3), vocab=24)
    out = run_both(*args)
    assert int(out.n_nodes) == 20


@pytest.mark.parametrize("log_tau", [-math.inf, 0.5])
def test_log_tau_extremes(log_tau):
    # -inf keeps every pool entry eligible; 0.5 is above every score (<= 0): nothing drafted.
    args, _ = realistic_args(7, 33, log_tau)
    out = run_both(*args)
    n_draft = int((out.source == DRAFT).sum())
    assert n_draft == (0 if log_tau > 0 else 32)


def test_score_ties_and_closure():
    # Pool (creation order):   0: a  -0.5  root child      3: d  -0.5  child of 0 (ties its parent)
    #                          1: b  -2.0  root child      4: e  -0.1  child of 1 (outscores its parent)
    #                          2: c  -0.5  root child      5: f  -0.0  root child (ties +0.0 below)
    #                          6: g  +0.0  root child
    # N - 1 = 5 best by (score desc, index asc): 5, 6, 4, 0, 2. Entry 4's parent (1) is not chosen,
    # so the closure drops it: kept 0, 2, 5, 6 (pool order), then candidates fill the budget.
    tokens = torch.tensor([10, 11, 12, 13, 14, 15, 16])
    parents = torch.tensor([-1, -1, -1, 0, 1, -1, -1])
    scores = torch.tensor([-0.5, -2.0, -0.5, -0.5, -0.1, -0.0, 0.0])
    depths = torch.tensor([1, 1, 1, 2, 2, 1, 1])
    cand = torch.tensor([12, 13, 17], dtype=torch.int64)          # 12 reuses node 2; 13 under it; 17 dropped
    cpar = torch.tensor([-1, 0, 0], dtype=torch.int32)
    csrc = torch.full((3,), RETRIEVAL, dtype=torch.int8)
    out = run_both(*on_device(tokens, parents, scores, depths, 7, torch.tensor(1), -math.inf, cand, cpar, csrc, 6))
    assert out.tokens.tolist() == [1, 10, 12, 15, 16, 13]
    assert out.parents.tolist() == [-1, 0, 0, 0, 0, 2]
    assert out.pool_index.tolist() == [-1, 0, 2, 5, 6, -1]
    assert out.source.tolist() == [ROOT, DRAFT, DRAFT, DRAFT, DRAFT, RETRIEVAL]
    assert out.depth.tolist() == [0, 1, 1, 1, 1, 2]


def test_default_template_two_mask_words_full():
    # 80-node template + chain, N = 48 > 32, no drafter (retrieval only): a dense M fills it.
    template = default_template(8)
    cands = on_device(*make_candidates(8, 50, 7, [1, 2, 3], template, missing=0.0))
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    out = run_both(empty, empty, torch.zeros(0, device=DEVICE), empty, 0, torch.tensor(7, device=DEVICE), 0.0,
                   *cands, 48)
    assert int(out.n_nodes) == 48 and out.mask.shape == (48, 2)


def test_bad_arguments():
    args = batched(realistic_args(0, 16, 0.0)[0])
    for fn in (build_tree, build_tree_kernel):
        with pytest.raises(ValueError, match="budget_n"):
            fn(*args[:10], 0)
        with pytest.raises(ValueError, match="pool tensors"):
            fn(args[0], args[1][:, :-1], *args[2:])
        with pytest.raises(ValueError, match="cand_tokens must be"):
            fn(*args[:7], args[7][:1], *args[8:])
    with pytest.raises(ValueError, match="n_pool"):
        build_tree(*args[:4], args[4] + args[0].shape[1], *args[5:])


# ------------------------------------------------------------------ the allocator: budget by estimated acceptance
def random_values(args, seed):
    """log P(accepted) per pool entry and per candidate, with ties between them (on DEVICE)."""
    g = torch.Generator().manual_seed(seed + 77)
    pool_values = -torch.rand(args[0].shape[0], generator=g) * 4
    cand_values = -torch.rand(args[7].shape[0], generator=g) * 4
    cand_values[::5] = pool_values[0]
    return on_device(pool_values, cand_values)


@pytest.mark.parametrize("N,log_tau", [(8, math.log(0.05)), (16, math.log(0.05)), (40, math.log(0.1)),
                                       (64, math.log(0.2))])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_values_match_reference(seed, N, log_tau):
    args, _ = realistic_args(seed, N, log_tau)
    pool_values, cand_values = random_values(args, seed)
    out = run_both(*args, pool_values, cand_values)
    # every candidate that landed in the tree points at a node with its token
    cand_node, tokens = out.cand_node.long(), out.tokens
    landed = cand_node >= 0
    assert torch.equal(tokens[cand_node[landed]], args[7][landed])


def _no_pool():
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    return empty, empty, torch.zeros(0, device=DEVICE), empty, 0


def test_budget_goes_to_the_likeliest_candidates():
    # Candidates: root children a, b, c (P = .5, .2, .1); x under a (.8 given a: .4), y under x
    # (.75 given x: .3). With N = 4, index order would take a, b, c; by estimated acceptance the
    # chain a -> x -> y wins.
    cand = torch.tensor([1, 2, 3, 4, 5])
    cpar = torch.tensor([-1, -1, -1, 0, 3], dtype=torch.int32)
    csrc = torch.full((5,), RETRIEVAL, dtype=torch.int8)
    values = torch.tensor([0.5, 0.2, 0.1, 0.8, 0.75]).log()
    out = run_both(*_no_pool(), torch.tensor(9, device=DEVICE), 0.0, *on_device(cand, cpar, csrc), 4,
                   None, values.to(DEVICE))
    assert out.tokens.tolist() == [9, 1, 4, 5] and out.parents.tolist() == [-1, 0, 1, 2]
    assert out.cand_node.tolist() == [1, -1, -1, 2, 3]
    assert torch.allclose(out.values.exp().cpu(), torch.tensor([1.0, 0.5, 0.4, 0.3]))
    # without values: index order, the old BFS fill
    plain = run_both(*_no_pool(), torch.tensor(9, device=DEVICE), 0.0, *on_device(cand, cpar, csrc), 4)
    assert plain.tokens.tolist() == [9, 1, 2, 3]


def test_drafted_nodes_compete_and_a_child_is_never_likelier_than_its_parent():
    # Drafted: a (-0.1 score) with child b; their estimates are low (.05). Candidates: c at the root
    # (.5 of the .95 that a leaves free: .475), d under c with an estimate above 1 that is clamped
    # so d is no likelier than c, e at the root (.3 x .95). N = 4: c, d (after c by index) and e
    # beat both drafted nodes.
    tokens, parents = torch.tensor([10, 11]), torch.tensor([-1, 0])
    scores, depths = torch.tensor([-0.1, -0.2]), torch.tensor([1, 2])
    pool_values = torch.tensor([0.05, 0.05]).log()
    cand = torch.tensor([12, 13, 14])
    cpar = torch.tensor([-1, 0, -1], dtype=torch.int32)
    csrc = torch.full((3,), RETRIEVAL, dtype=torch.int8)
    cand_values = torch.tensor([0.5, 1.5, 0.3]).log()
    out = run_both(*on_device(tokens, parents, scores, depths, 2, torch.tensor(1), -math.inf, cand, cpar, csrc, 4,
                              pool_values, cand_values))
    assert out.tokens.tolist() == [1, 12, 13, 14] and out.parents.tolist() == [-1, 0, 1, 0]
    assert (out.pool_index == -1).all() and (out.source[1:] == RETRIEVAL).all()
    assert torch.allclose(out.values.exp().cpu(), torch.tensor([1.0, 0.475, 0.475, 0.285]))
    # with N = 6 everything fits: drafted nodes first, in pool order, then the candidates
    out = run_both(*on_device(tokens, parents, scores, depths, 2, torch.tensor(1), -math.inf, cand, cpar, csrc, 6,
                              pool_values, cand_values))
    assert out.tokens.tolist() == [1, 10, 11, 12, 13, 14] and out.pool_index.tolist() == [-1, 0, 1, -1, -1, -1]


def test_a_candidate_on_a_drafted_node_raises_its_estimate():
    # Drafted a (.05) and b (.04) at the root; a retrieval candidate repeats b with .6 (of the .95
    # that a leaves free: .57) and continues under it with x (.5 given b: .285). N = 3: b and x
    # beat a.
    tokens, parents = torch.tensor([10, 11]), torch.tensor([-1, -1])
    scores, depths = torch.tensor([-0.1, -0.2]), torch.tensor([1, 1])
    cand, cpar = torch.tensor([11, 20]), torch.tensor([-1, 0], dtype=torch.int32)
    csrc = torch.full((2,), RETRIEVAL, dtype=torch.int8)
    out = run_both(*on_device(tokens, parents, scores, depths, 2, torch.tensor(1), -math.inf, cand, cpar, csrc, 3,
                              torch.tensor([0.05, 0.04]).log(), torch.tensor([0.6, 0.5]).log()))
    assert out.tokens.tolist() == [1, 11, 20] and out.source.tolist() == [ROOT, DRAFT, RETRIEVAL]
    assert out.pool_index.tolist() == [-1, 1, -1] and out.cand_node.tolist() == [1, 2]
    assert torch.allclose(out.values.exp().cpu(), torch.tensor([1.0, 0.57, 0.285]))


def test_a_chain_under_a_drafted_node_is_valued_through_that_node():
    # Drafted a (.9); a retrieval candidate r (.02: a token of its own is rarely right) that repeats
    # a, and x under it (.5 given its parent). x's path is a -> x: .9 x .5 = .45, not .02 x .5.
    tokens, parents = torch.tensor([10]), torch.tensor([-1])
    scores, depths = torch.tensor([-0.1]), torch.tensor([1])
    cand, cpar = torch.tensor([10, 20]), torch.tensor([-1, 0], dtype=torch.int32)
    csrc = torch.full((2,), RETRIEVAL, dtype=torch.int8)
    out = run_both(*on_device(tokens, parents, scores, depths, 1, torch.tensor(1), -math.inf, cand, cpar, csrc, 4,
                              torch.tensor([0.9]).log(), torch.tensor([0.02, 0.5]).log()))
    assert out.tokens.tolist() == [1, 10, 20, -1] and out.source.tolist() == [ROOT, DRAFT, RETRIEVAL, -1]
    assert torch.allclose(out.values[:3].exp().cpu(), torch.tensor([1.0, 0.9, 0.45]))
    assert out.values[3] == -math.inf


def test_a_candidate_beside_a_sure_drafted_sibling_gets_only_the_share_it_leaves_free():
    # Drafted a (.96) at the root and b under it (.9: .9375 given a). Retrieval repeats a and b
    # (.01 each: they keep the drafter's values) and proposes r at the root, t under a beside b and
    # s under b, each .5 given its parent. Children of one node are exclusive, so r can be accepted
    # only when a is not (.04 x .5 = .02) and t only when b is not (.96 x .0625 x .5 = .03); s, under
    # the drafter's tip, has no drafted sibling (.9 x .5 = .45). Valued alone, r (.5) would have
    # taken a place before s.
    tokens, parents = torch.tensor([10, 11]), torch.tensor([-1, 0])
    scores, depths = torch.tensor([-0.05, -0.1]), torch.tensor([1, 2])
    cand, cpar = torch.tensor([10, 11, 20, 21, 22]), torch.tensor([-1, 0, -1, 0, 1], dtype=torch.int32)
    csrc = torch.full((5,), RETRIEVAL, dtype=torch.int8)
    values = torch.tensor([0.96, 0.9]).log(), torch.tensor([0.01, 0.01, 0.5, 0.5, 0.5]).log()
    out = run_both(*on_device(tokens, parents, scores, depths, 2, torch.tensor(1), -math.inf, cand, cpar, csrc, 6,
                              *values))
    assert out.tokens.tolist() == [1, 10, 11, 20, 21, 22] and out.parents.tolist() == [-1, 0, 1, 0, 1, 2]
    assert torch.allclose(out.values.exp().cpu(), torch.tensor([1.0, 0.96, 0.9, 0.02, 0.03, 0.45]))
    out = run_both(*on_device(tokens, parents, scores, depths, 2, torch.tensor(1), -math.inf, cand, cpar, csrc, 4,
                              *values))
    assert out.tokens.tolist() == [1, 10, 11, 22]
    # drafted siblings whose estimates sum past 1 leave the floor, not a negative share
    over = torch.tensor([0.7, 0.6]).log(), torch.tensor([0.5]).log()
    out = run_both(*on_device(tokens, torch.tensor([-1, -1]), scores, torch.tensor([1, 1]), 2, torch.tensor(1),
                              -math.inf, cand[2:3], cpar[2:3], csrc[:1], 4, *over))
    assert out.tokens.tolist() == [1, 10, 11, 20]
    assert out.values[3].exp().item() == pytest.approx(0.5 * FREE_FLOOR, rel=1e-4)


def test_per_row_candidate_sources():
    """cand_source [B, C]: each row its own codes (the adjacency source re-proposes a row's drafted
    path as DRAFT, then its retrieved continuation). A candidate that brings back a drafted token
    the pruning cut gets its row's code; kernel = reference."""
    tokens, parents = torch.tensor([10, 11]), torch.tensor([-1, 0])
    scores, depths = torch.tensor([-0.1, -3.0]), torch.tensor([1, 2])
    cand, cpar = torch.tensor([10, 11, 30]), torch.tensor([-1, 0, 1], dtype=torch.int32)
    csrc = torch.tensor([[DRAFT, DRAFT, RETRIEVAL], [RETRIEVAL, RETRIEVAL, RETRIEVAL]], dtype=torch.int8)
    args = on_device(torch.stack([tokens, tokens]), torch.stack([parents, parents]), torch.stack([scores, scores]),
                     torch.stack([depths, depths]), torch.tensor([2, 2]), torch.tensor([1, 1]),
                     torch.tensor([-1.0, -1.0]), torch.stack([cand, cand]), cpar, csrc, 6)
    got, want = build_tree_kernel(*args), build_tree(*args)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # node 11 was pruned (score -3 < log tau -1): the candidate restores it, with its row's code
    assert want.tokens[:, :4].tolist() == [[1, 10, 11, 30]] * 2
    assert want.source[0, :4].tolist() == [ROOT, DRAFT, DRAFT, RETRIEVAL]
    assert want.source[1, :4].tolist() == [ROOT, DRAFT, RETRIEVAL, RETRIEVAL]
