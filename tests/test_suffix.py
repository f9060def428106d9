"""Suffix decoding (graft_tk.sources.suffix): the latest occurrences of the longest repeated suffix,
their continuations as chains that build_tree merges into a trie, valued by match length and support.

The op is checked against a plain-Python statement of the rule, a row of a batch against the row
alone; the source's candidates through build_tree, its counts, and greedy decoding against ``ar``.
"""
import math
import random

import pytest
import torch

import graft_tk
from graft_tk.acceptance import on_path_mask
from graft_tk.config import GraftConfig
from graft_tk.decode import encode_prompt
from graft_tk.errors import InputError
from graft_tk.reference.build_tree import build_tree
from graft_tk.sources import StepView, SuffixSource
from graft_tk.sources.suffix import suffix_chains
from graft_tk.tree import ROOT, SUFFIX

from .kernel_utils import DEVICE


def spec(tokens: list[int], G: int, P: int, L: int) -> tuple[list[list[int]], list[int]]:
    """The rule, written plainly: every earlier position j with its match m(j), the P best by
    (m, j) descending, the L tokens from each (cut at the end, -1 padded)."""
    n, found = len(tokens), []
    for j in range(1, n):
        m = 0
        while m < G and j - m - 1 >= 0 and tokens[j - m - 1] == tokens[n - m - 1]:
            m += 1
        if m:
            found.append((m, j))
    found = sorted(found, reverse=True)[:P]
    chains = [(tokens[j:j + L] + [-1] * L)[:L] for _, j in found] + [[-1] * L] * (P - len(found))
    return chains, [m for m, _ in found] + [0] * (P - len(found))


def trie_spec(chains: list[list[int]], match: list[int]) -> tuple[list[list[int]], list[list[bool]], list[list[int]]]:
    """Per candidate: its support, whether an earlier chain has its node, the node's matched length."""
    P, L = len(chains), len(chains[0])
    support, repeat, m = [[0] * L for _ in range(P)], [[False] * L for _ in range(P)], [[0] * L for _ in range(P)]
    for p in range(P):
        for d in range(L):
            path = chains[p][:d + 1]
            if -1 in path:
                continue
            sharing = [q for q in range(P) if chains[q][:d + 1] == path]
            support[p][d], repeat[p][d], m[p][d] = len(sharing), sharing[0] < p, max(match[q] for q in sharing)
    return support, repeat, m


def source(G=8, P=3, L=3) -> SuffixSource:
    return SuffixSource(GraftConfig(suffix_max_match=G, suffix_chains=P, suffix_tokens=L), None, DEVICE)


def propose(src: SuffixSource, rows: list[list[int]], spare: int = 3):
    """The source's candidates for ``rows`` as one batch, each row padded with junk past its length."""
    width = max(len(r) for r in rows) + spare
    context = torch.tensor([r + [7] * (width - len(r)) for r in rows], device=DEVICE)
    length = torch.tensor([len(r) for r in rows], device=DEVICE)
    return src.propose(StepView(context.gather(1, (length - 1)[:, None])[:, 0], context, length))


WORKED = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]     # the module docstring's example


def test_worked_example():
    context = torch.tensor([WORKED + [9, 9]], device=DEVICE)
    chains, match = suffix_chains(context, torch.tensor([11], device=DEVICE), 8, 3, 3)
    assert chains.tolist() == [[[4, 1, 2], [3, 1, 2], [3, 1, 2]]] and match.tolist() == [[5, 2, 2]]
    assert spec(WORKED, 8, 3, 3) == ([[4, 1, 2], [3, 1, 2], [3, 1, 2]], [5, 2, 2])
    # a shorter max match: every occurrence matches 2, the latest first
    assert spec(WORKED, 2, 3, 3) == ([[3, 1, 2], [4, 1, 2], [3, 1, 2]], [2, 2, 2])
    assert suffix_chains(context, torch.tensor([11], device=DEVICE), 2, 3, 3)[0].tolist() == [[[3, 1, 2], [4, 1, 2],
                                                                                              [3, 1, 2]]]


def test_chains_stop_at_the_context_end_and_missing_chains_are_minus_one():
    src = source(P=3, L=4)
    cand = propose(src, [[5, 6, 7, 5, 6]])       # one occurrence of 5 6, its chain cut at the end
    assert cand.tokens.tolist() == [[7, 5, 6, -1] + [-1] * 8]
    assert cand.note[0, 3:].eq(-1).all() and (cand.note[0, :3] >= 0).all()
    assert propose(src, [[1, 2, 3]]).tokens.eq(-1).all() and propose(src, [[4]]).tokens.eq(-1).all()
    # template: chain p is a path under the root
    assert src.parents.tolist() == [-1, 0, 1, 2, -1, 4, 5, 6, -1, 8, 9, 10]


@pytest.mark.parametrize("seed", range(3))
def test_random_contexts_follow_the_rule(seed):
    rng = random.Random(seed)
    for trial in range(30):
        rows = [[rng.randrange(3) for _ in range(rng.randrange(1, 40))] for _ in range(3)]   # small vocab: repeats
        G, P, L = rng.randrange(1, 6), rng.randrange(1, 5), rng.randrange(1, 5)
        width = max(map(len, rows)) + 2
        context = torch.tensor([r + [rng.randrange(3)] * (width - len(r)) for r in rows], device=DEVICE)
        chains, match = suffix_chains(context, torch.tensor([len(r) for r in rows], device=DEVICE), G, P, L)
        for b, row in enumerate(rows):
            assert (chains[b].tolist(), match[b].tolist()) == spec(row, G, P, L), (trial, row, G, P, L)


def test_values_rank_by_support_and_repeats_are_marked():
    # With G = 1 every occurrence of 7 matches 1: it was followed by 1 three times, by 2 once.
    src = source(G=1, P=4, L=2)
    cand = propose(src, [[7, 1, 7, 1, 7, 2, 7, 1, 7]])
    assert cand.tokens.tolist() == [[1, 7, 2, 7, 1, 7, 1, 7]]          # by position, latest first
    value = cand.values[0].exp().tolist()
    assert value[0] > value[2]                                         # 1 (3 of 4) beats 2 (1 of 4)
    assert value[4:] == value[:2] * 2                                  # repeats carry their node's value
    note = cand.note[0].tolist()
    assert note[4:] == [-1] * 4 and min(note[:4]) >= 0                 # chains 2, 3 repeat chain 0's nodes
    # the priors: base(m) raised by each supporting occurrence
    rate = src.rates.rate()
    assert rate[0, 2, 0] == pytest.approx(1 - 0.7 ** 3) and rate[0, 0, 0] == pytest.approx(0.3)
    assert (rate[:, 1:] >= rate[:, :-1]).all() and (rate[1:] >= rate[:-1]).all() and rate.max() <= 0.9


def test_propose_matches_the_trie_rule():
    rng = random.Random(5)
    src = source(G=4, P=4, L=3)
    log_rate = src.rates.rate().log()
    for _ in range(30):
        row = [rng.randrange(3) for _ in range(rng.randrange(2, 30))]
        cand = propose(src, [row])
        chains, match = spec(row, 4, 4, 3)
        support, repeat, m = trie_spec(chains, match)
        assert cand.tokens[0].tolist() == sum(chains, [])
        for p in range(4):
            for d in range(3):
                c = p * 3 + d
                if chains[p][d] < 0:
                    assert cand.note[0, c] == -1
                    continue
                assert cand.values[0, c] == log_rate[m[p][d] - 1, support[p][d] - 1, d], (row, p, d)
                assert (cand.note[0, c] == -1) == repeat[p][d], (row, p, d)


def test_a_batch_of_ragged_rows_equals_each_row_alone():
    rng = random.Random(6)
    src = source(G=5, P=3, L=4)
    rows = [[rng.randrange(4) for _ in range(n)] for n in (1, 7, 30, 18, 2)]
    together = propose(src, rows, spare=5)
    for b, row in enumerate(rows):
        alone = propose(src, [row], spare=0)
        for got, want in zip(together, alone):
            if got is not None:
                assert torch.equal(got[b], want[0]), b


def tree_of(src: SuffixSource, cand, budget: int = 16, root: int = 0):
    """build_tree of one row holding the suffix source's candidates only."""
    C = cand.tokens.shape[1]
    empty = torch.zeros(1, 0, device=DEVICE)
    return build_tree(empty.long(), empty.long(), empty, empty.long(), torch.zeros(1, dtype=torch.long, device=DEVICE),
                      torch.tensor([root], device=DEVICE), torch.tensor([-math.inf], device=DEVICE), cand.tokens,
                      src.parents, torch.full((C,), SUFFIX, dtype=torch.int8, device=DEVICE), budget,
                      None, cand.values)


def test_build_tree_merges_the_chains_into_a_trie():
    # Chains 4 1 2 | 3 1 2 | 3 1 2: the third lands on the second's nodes, no budget spent.
    src = source()
    built = tree_of(src, propose(src, [WORKED]))
    node = built.cand_node[0].tolist()
    assert node[6:] == node[3:6] and len(set(node[:6])) == 6 and int(built.n_nodes[0]) == 7
    t = built.row(0)
    assert t.source.tolist() == [ROOT] + [SUFFIX] * 6
    # Chains that share a prefix and then differ: the second branches under the shared node.
    cand = propose(src, [[9, 3, 1, 5, 9, 3, 1, 2, 9]])    # 9 followed by 3 1 2 (latest), then 3 1 5
    assert cand.tokens[0, :6].tolist() == [3, 1, 2, 3, 1, 5]
    built = tree_of(src, cand, root=9)
    node = built.cand_node[0].tolist()
    assert node[3:5] == node[0:2] and node[5] not in node[:3]
    assert int(built.parents[0, node[5]]) == node[1]   # 5's parent: the shared 1
    assert built.tokens[0, :int(built.n_nodes[0])].tolist() == [9, 3, 1, 2, 5]
    # the shared 3 is valued at support 2 (both occurrences continued with it)
    assert built.values[0, node[0]] == src.rates.rate().log()[0, 1, 0]


def test_observe_counts_each_node_once():
    src = source()
    cand = propose(src, [WORKED])
    built = tree_of(src, cand)
    node = built.cand_node[0].tolist()
    path = torch.full((1, 16), -1, dtype=torch.long, device=DEVICE)
    path[0, :3] = torch.tensor([0, node[3], node[4]])            # root, 3, 1 accepted; 2 rejected
    src.observe(built, on_path_mask(path), built.cand_node, cand.note)
    cells = cand.note[0].tolist()
    n, acc = src.rates.n.view(-1), src.rates.acc.view(-1)
    # chain 1 (3 1 2, support 2): three nodes tried once each (not twice), the first two accepted
    assert [n[c].item() for c in cells[3:6]] == [1, 1, 1] and [acc[c].item() for c in cells[3:6]] == [1, 1, 0]
    # chain 0 (4 1 2): its first node tried and rejected, the rest never tried (parent rejected)
    assert [n[c].item() for c in cells[:3]] == [1, 0, 0] and acc[cells[0]] == 0
    assert n.sum() == 4 and acc.sum() == 2
    # the estimates moved: the accepted cells up, the rejected ones down
    prior = SuffixSource(GraftConfig(suffix_chains=3, suffix_tokens=3), None, DEVICE).rates.rate().view(-1)
    rate = src.rates.rate().view(-1)
    assert rate[cells[3]] > prior[cells[3]] and rate[cells[5]] < prior[cells[5]] and rate[cells[0]] < prior[cells[0]]


@pytest.mark.parametrize("field", ["suffix_max_match", "suffix_chains", "suffix_tokens"])
def test_bad_config_is_a_clear_error(field):
    for bad in (0, 1.5, True):
        with pytest.raises(InputError, match=field):
            GraftConfig(**{field: bad})


REPEATING = "Repeat this list exactly three times: red fish, blue fish, one fish, two fish, old fish, new fish."


@pytest.fixture(scope="module")
def self_drafter():
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=10, progress=False)


def test_greedy_suffix_methods_equal_ar(smollm2, self_drafter):
    """fp32, greedy: token for token plain decoding's, and suffix decoding's nodes are accepted."""
    ids = encode_prompt(smollm2, REPEATING, chat=True)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=48)
    for method in ("suffix", "graft"):
        got = graft_tk.decode(smollm2, ids, drafter=self_drafter, method=method, max_new_tokens=48,
                              config=GraftConfig(budget=12))
        assert got.tokens == ref.tokens, method
        s = got.stats
        assert set(s["nodes_by_source"]) <= {"draft", "retrieval", "prompt_lookup", "suffix"}
        assert {src: sum(d.values()) for src, d in s["accepted_by_source_depth"].items()} == s["accepted_by_source"]
    suffix = graft_tk.decode(smollm2, ids, method="suffix", max_new_tokens=48, config=GraftConfig(budget=12)).stats
    assert suffix["accepted_by_source"].get("suffix", 0) > 0 and suffix["mat"] > 1.2
    assert set(suffix["accepted_by_source"]) == {"suffix"}
