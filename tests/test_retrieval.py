"""Token Recycling: successor-matrix updates, templates (graft_tk.adjacency), root-parallel retrieval,
and the adjacency source's grafts at the drafter's tips."""
import math

import pytest
import torch

from graft_tk.adjacency import (RetrievalTemplate, default_template, new_adjacency, template_from_level_sizes,
                                 update_adjacency, warm_adjacency)
from graft_tk.reference.retrieve import retrieve

V, K = 16, 2


def logits_ranking(*ranked, vocab=V):
    """A logits row whose top tokens are ``ranked`` in that order (the rest far below)."""
    row = torch.full((vocab,), -10.0)
    for i, t in enumerate(ranked):
        row[t] = 5.0 - i
    return row


def small_template():
    # root -> {r0, r1}; r0 -> {r0, r1}; r1 -> {r0}; (r0, r0) -> {r0}
    return RetrievalTemplate(torch.tensor([-1, -1, 0, 0, 1, 2]), torch.tensor([0, 1, 0, 1, 0, 0]), k=K)


def test_new_adjacency_is_empty():
    adj = new_adjacency(V, K)
    assert adj.shape == (V, K) and adj.dtype == torch.int32 and (adj == -1).all()


def test_retrieve_walks_levels():
    adj = new_adjacency(V, K)
    adj[5] = torch.tensor([7, 9], dtype=torch.int32)
    adj[7] = torch.tensor([3, 4], dtype=torch.int32)
    adj[9] = torch.tensor([8, 2], dtype=torch.int32)
    adj[3] = torch.tensor([1, 0], dtype=torch.int32)
    t = small_template()
    assert t.levels == ((0, 2), (2, 5), (5, 6))
    assert torch.equal(t.depth, torch.tensor([1, 1, 2, 2, 2, 3], dtype=torch.int32))
    out = retrieve(adj, torch.tensor([5, 9]), t)                  # two rows, each from its own root
    assert out.dtype == torch.int64
    assert torch.equal(out, torch.tensor([[7, 9, 3, 4, 8, 1], [8, 2, -1, -1, -1, -1]]))


def test_empty_rows_propagate_minus_one():
    adj = new_adjacency(V, K)
    adj[5] = torch.tensor([7, -1], dtype=torch.int32)  # empty column: node 1 and its child 4 missing
    adj[7] = torch.tensor([3, 4], dtype=torch.int32)   # row 3 empty: node 5 missing
    out = retrieve(adj, torch.tensor([5]), small_template())
    assert torch.equal(out, torch.tensor([[7, -1, 3, 4, -1, -1]]))
    # An unseen root token: everything is -1.
    assert torch.equal(retrieve(adj, torch.tensor([0]), small_template()), torch.full((1, 6), -1))


def test_update_writes_topk_rows():
    adj = new_adjacency(V, K)
    tokens = torch.tensor([2, 6])
    logits = torch.stack([logits_ranking(11, 12), logits_ranking(13, 14)])
    update_adjacency(adj, tokens, logits)
    assert torch.equal(adj[2], torch.tensor([11, 12], dtype=torch.int32))
    assert torch.equal(adj[6], torch.tensor([13, 14], dtype=torch.int32))
    assert (adj[[0, 1, 3, 4, 5]] == -1).all()


def test_update_order_last_writer_wins():
    # Token 3 sits at nodes 0, 2 and 3; the row must come from whichever is last in `order`.
    tokens = torch.tensor([3, 1, 3, 3])
    logits = torch.stack([logits_ranking(10, 11), logits_ranking(4, 5),
                          logits_ranking(12, 13), logits_ranking(14, 15)])
    adj = update_adjacency(new_adjacency(V, K), tokens, logits)
    assert torch.equal(adj[3], torch.tensor([14, 15], dtype=torch.int32))      # default order: node 3
    adj = update_adjacency(new_adjacency(V, K), tokens, logits, order=torch.tensor([3, 1, 2, 0]))
    assert torch.equal(adj[3], torch.tensor([10, 11], dtype=torch.int32))      # node 0 written last
    adj = update_adjacency(new_adjacency(V, K), tokens, logits, order=torch.tensor([0, 3, 2, 1]))
    assert torch.equal(adj[3], torch.tensor([12, 13], dtype=torch.int32))      # node 2 last among 3s
    assert torch.equal(adj[1], torch.tensor([4, 5], dtype=torch.int32))


def test_warm_from_prefill():
    prompt = torch.tensor([1, 2, 1, 3])
    logits = torch.stack([logits_ranking(2, 9), logits_ranking(1, 8),
                          logits_ranking(3, 7), logits_ranking(6, 5)])
    adj = warm_adjacency(new_adjacency(V, K), prompt, logits, head=lambda x: x)
    assert torch.equal(adj[1], torch.tensor([3, 7], dtype=torch.int32))   # later occurrence of 1 wins
    assert torch.equal(adj[2], torch.tensor([1, 8], dtype=torch.int32))
    assert torch.equal(adj[3], torch.tensor([6, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="logits must be"):
        warm_adjacency(adj, prompt, logits[:, :8], head=lambda x: x)


def test_the_source_warms_chunk_by_chunk_as_in_one_piece_within_its_window():
    """AdjacencySource.warm called per chunk of a prompt as it is read (start = the chunk's first
    position) leaves the M one call over the whole prompt leaves, its window counted from the
    prompt's end: chunks before the window add nothing."""
    from graft_tk.config import GraftConfig
    from graft_tk.ops import ops_for
    from graft_tk.sources import AdjacencySource
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (30,), generator=g)
    hidden = torch.randn(30, V, generator=g)

    def source():
        return AdjacencySource(GraftConfig(retrieval_k=K, template=(2, 2), tip_template=(), warm_window=12),
                               ops_for("torch", "cpu"), "cpu", vocab_size=V)
    whole, chunked = source(), source()
    whole.warm(prompt, hidden, lambda x: x)
    for start in range(0, 30, 7):
        chunked.warm(prompt, hidden[start:start + 7], lambda x: x, start=start)
    assert torch.equal(chunked.matrix, whole.matrix)
    window = update_adjacency(new_adjacency(V, K), prompt[18:], hidden[18:])
    assert torch.equal(whole.matrix, window)
    early = source()
    early.warm(prompt, hidden[:14], lambda x: x, start=0)      # wholly before the window
    assert (early.matrix == -1).all()


def test_warm_in_chunks_matches_one_piece(monkeypatch):
    # A prompt whose logits do not fit one chunk: ranked a few positions at a time (tokens repeat
    # across chunks, so the later-position rule must hold across them), the same M as in one piece,
    # and no head call ever sees more rows than a chunk holds.
    import graft_tk.adjacency as adjacency
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 5, (23,), generator=g)
    hidden = torch.randn(23, 6, generator=g)
    weight = torch.randn(V, 6, generator=g)
    whole = update_adjacency(new_adjacency(V, K), prompt, hidden @ weight.T)
    monkeypatch.setattr(adjacency, "WARM_LOGITS_PER_CHUNK", 4 * V)
    rows_seen = []

    def head(x):
        rows_seen.append(x.shape[0])
        return x @ weight.T

    assert torch.equal(adjacency.warm_adjacency(new_adjacency(V, K), prompt, hidden, head), whole)
    assert rows_seen == [4, 4, 4, 4, 4, 3]


def test_default_template_shape():
    t = default_template()
    assert t.n == 80 and t.k == 8
    assert t.level_sizes() == [8, 21, 25, 15, 8, 3]
    assert torch.equal(t.ranks[:8], torch.arange(8, dtype=torch.int32))
    # Lower ranks get more children: each level-1 node has at least as many as the next.
    kids = torch.bincount(t.parents[8:29].long(), minlength=8)
    assert (kids[:-1] >= kids[1:]).all() and kids[0] > kids[-1]
    # Each parent's children are ranks 0..m-1 (a prefix), and retrieval runs on it.
    adj = torch.randint(0, 32, (32, 8), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    out = retrieve(adj, torch.tensor([1]), t)[0]
    assert out.shape == (80,) and (out >= 0).all()


def test_template_validation():
    with pytest.raises(ValueError, match=r"rank 2; ranks must be in \[0, k=2\)"):
        RetrievalTemplate(torch.tensor([-1, 0]), torch.tensor([0, 2]), k=2)
    with pytest.raises(ValueError, match="parent 1; need -1"):
        RetrievalTemplate(torch.tensor([-1, 1]), torch.tensor([0, 0]), k=2)
    with pytest.raises(ValueError, match="breaks BFS order"):
        RetrievalTemplate(torch.tensor([-1, 0, -1]), torch.tensor([0, 0, 1]), k=2)
    with pytest.raises(ValueError, match="repeats"):
        RetrievalTemplate(torch.tensor([-1, -1]), torch.tensor([0, 0]), k=2)
    with pytest.raises(ValueError, match="level 1 size"):
        template_from_level_sizes([9], k=8)
    with pytest.raises(ValueError, match="level 2 size"):
        template_from_level_sizes([2, 5], k=2)
    with pytest.raises(ValueError, match="adj has only"):
        retrieve(new_adjacency(V, 1), torch.tensor([0]), small_template())


def test_update_matches_sequential_writes():
    # Many duplicates and a shuffled order vs the obvious Python loop (the definition).
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 5, (40,), generator=g)
    logits = torch.randn(40, V, generator=g)
    order = torch.randperm(40, generator=g)
    expected = new_adjacency(V, 3)
    for i in order.tolist():
        expected[tokens[i]] = torch.topk(logits[i], 3).indices.to(torch.int32)
    assert torch.equal(update_adjacency(new_adjacency(V, 3), tokens, logits, order), expected)


def test_tips_graft_retrieval_beneath_the_best_drafted_node_of_each_depth():
    """The adjacency source's tip blocks: per drafted depth d, the path to the best node of that
    depth (marked DRAFT, valued by the drafter's estimates given the parent), then M's template
    beneath it; build_tree puts the path on the drafted nodes and the continuation below them."""
    from graft_tk.config import GraftConfig
    from graft_tk.ops import ops_for
    from graft_tk.reference.build_tree import build_tree
    from graft_tk.sources import StepView
    from graft_tk.sources.adjacency import AdjacencySource
    from graft_tk.tree import DRAFT, RETRIEVAL
    source = AdjacencySource(GraftConfig(template=(1,), tip_template=(1, 1), max_depth=2, retrieval_k=K),
                             ops_for("torch", "cpu"), "cpu", vocab_size=V)
    source.matrix[1] = torch.tensor([4, 5], dtype=torch.int32)      # root 1 -> 4
    source.matrix[10] = torch.tensor([6, 7], dtype=torch.int32)     # depth-1 tip 10 -> 6 -> 8
    source.matrix[6] = torch.tensor([8, 9], dtype=torch.int32)
    source.matrix[12] = torch.tensor([13, 7], dtype=torch.int32)    # depth-2 tip 12 -> 13 -> (none)
    # pool: 10 (P .9), 11 (P .05) at depth 1; 12 under 10 (P .8) at depth 2; past n: garbage
    pool = dict(pool_tokens=torch.tensor([[10, 11, 12, 3]]), pool_parents=torch.tensor([[-1, -1, 0, 0]]),
                pool_depth=torch.tensor([[1, 1, 2, 2]]), pool_n=torch.tensor([3]),
                pool_values=torch.tensor([[0.9, 0.05, 0.8, 1.0]]).log())
    view = StepView(torch.tensor([1]), torch.tensor([[1]]), torch.tensor([1]), **pool)
    cand = source.propose(view)
    # root template [4]; block 1: [10 | 6, 8]; block 2: [10, 12 | 13, -1]
    assert cand.tokens.tolist() == [[4, 10, 6, 8, 10, 12, 13, -1]]
    assert cand.source.tolist() == [[RETRIEVAL, DRAFT, RETRIEVAL, RETRIEVAL, DRAFT, DRAFT, RETRIEVAL, RETRIEVAL]]
    assert source.parents.tolist() == [-1, -1, 1, 2, -1, 4, 5, 6]
    assert torch.allclose(cand.values[0, [1, 4, 5]].exp(), torch.tensor([0.9, 0.9, 0.8 / 0.9]))
    built = build_tree(pool["pool_tokens"], pool["pool_parents"], pool["pool_values"], pool["pool_depth"],
                       pool["pool_n"], torch.tensor([1]), torch.tensor([-math.inf]), cand.tokens,
                       source.parents, cand.source, 8, pool["pool_values"], cand.values)
    n = int(built.n_nodes[0])
    tree = list(zip(built.tokens[0, :n].tolist(), built.parents[0, :n].tolist(), built.source[0, :n].tolist()))
    node = {tok: i for i, (tok, _, _) in enumerate(tree)}
    assert tree[node[12]][1] == node[10] and tree[node[12]][2] == DRAFT          # drafted, not re-added
    assert tree[node[13]][1] == node[12] and tree[node[13]][2] == RETRIEVAL      # M below the depth-2 tip
    assert tree[node[6]][1] == node[10] and tree[node[8]][1] == node[6]          # and below the depth-1 tip
    # no drafted pool: the tip blocks are empty
    assert (source.propose(StepView(torch.tensor([1]), torch.tensor([[1]]), torch.tensor([1]))).tokens[0, 1:] == -1).all()
