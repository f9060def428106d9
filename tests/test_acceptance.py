"""The online acceptance rates each source ranks its candidates by (graft_tk.acceptance, graft_tk.sources)."""
import math

import numpy as np
import pytest
import torch

from graft_tk.acceptance import PRIOR_WEIGHT, SCORE_EDGES, DraftRates, isotonic_fit, node_probs, on_path_mask
from graft_tk.calibration.warm_start import isotonic_increasing
from graft_tk.config import GraftConfig
from graft_tk.ops import ops_for
from graft_tk.reference.build_tree import build_tree
from graft_tk.sources import AdjacencySource, PromptLookupSource, StepView
from graft_tk.tree import DRAFT, PROMPT_LOOKUP, RETRIEVAL, ROOT

OPS = ops_for("torch", "cpu")


def test_isotonic_fit_equals_pool_adjacent_violators():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        rate = torch.rand(12, generator=g, dtype=torch.float64)
        weight = torch.randint(1, 6, (12,), generator=g).double()
        # PAV on the expanded samples (weight w = w copies) is the weighted fit
        x = np.repeat(np.arange(12), weight.int().numpy())
        y = np.repeat(rate.numpy(), weight.int().numpy())
        _, fitted = isotonic_increasing(x, y)
        want = [fitted[x == b][0] for b in range(12)]
        assert np.allclose(isotonic_fit(rate, weight).numpy(), want)


def adjacency(levels=(2, 2)):
    """Retrieval at the root only (the tip grafts: tests/test_retrieval.py)."""
    return AdjacencySource(GraftConfig(retrieval_k=2, template=levels, tip_template=()), OPS, "cpu", vocab_size=16)


def lookup(pld_tokens=3, pld_max_ngram=2):
    return PromptLookupSource(GraftConfig(pld_tokens=pld_tokens, pld_max_ngram=pld_max_ngram), OPS, "cpu")


def tree(pool=None, cand=None, cand_parents=None, cand_source=None, budget=8, pool_values=None, cand_values=None,
         root=0):
    """build_tree of one row from plain lists (pool: tokens, parents, scores, depths)."""
    tokens, parents, scores, depths = pool or ([], [], [], [])
    one = lambda x, dtype=None: torch.tensor([x], dtype=dtype)   # noqa: E731
    return build_tree(one(tokens, torch.long), one(parents, torch.long), one(scores, torch.float32),
                      one(depths, torch.long), torch.tensor([len(tokens)]), torch.tensor([root]),
                      torch.tensor([-math.inf]), one(cand, torch.long), torch.tensor(cand_parents, dtype=torch.int32),
                      torch.tensor(cand_source, dtype=torch.int8), budget,
                      None if pool_values is None else pool_values[None],
                      None if cand_values is None else cand_values[None])


def test_priors():
    rates = DraftRates(None, "cpu").rate()
    # drafted: the drafter's own probability, non-decreasing in the score
    assert (rates[1:] >= rates[:-1]).all() and rates[-1] > 0.8 and rates[0] < 0.01
    # retrieval, given the parent accepted: by rank (template: [r0, r1], then r0 and r1 under r0)
    assert torch.allclose(adjacency().rates.rate(), torch.tensor([0.4, 0.24, 0.4, 0.24]))
    # prompt lookup, given the previous position accepted: a longer match is likelier
    assert torch.allclose(lookup().rates.rate(), torch.tensor([0.3, 0.5]))


def _step(source, retrieved, accepted_depth):
    """One step of a retrieval-only tree: accept the rank-0 chain down to ``accepted_depth``."""
    values = source.rates.rate().log()
    built = tree(cand=retrieved, cand_parents=source.parents.tolist(), cand_source=[RETRIEVAL] * len(retrieved),
                 cand_values=values)
    # nodes of the rank-0 chain: template 0, then its rank-0 child (template node 2)
    chain = [0] + [int(built.cand_node[0, i]) for i in (0, 2)][:accepted_depth]
    path = torch.full((1, 8), -1, dtype=torch.long)
    path[0, :len(chain)] = torch.tensor(chain)
    source.observe(built, on_path_mask(path), built.cand_node, None)
    return built


def test_retrieval_rates_learn_which_positions_are_accepted():
    source = adjacency()       # [r0, r1] at depth 1, r0 and r1 under r0 at depth 2
    retrieved = [5, 6, 7, 8]
    for _ in range(30):
        _step(source, retrieved, accepted_depth=2)
    rate = source.rates.rate()
    # r0 and its rank-0 child: always accepted once tried -> close to 1; r1 never -> close to 0
    assert rate[0] > 0.9 and rate[2] > 0.85 and rate[1] < 0.1 and rate[3] < 0.1
    # the tree's values are the paths': r0 -> its child multiplies the two
    built = _step(source, retrieved, accepted_depth=2)
    assert node_probs(built)[0, built.cand_node[0, 2]] == pytest.approx(float(rate[0] * rate[2]), rel=0.05)


def test_a_candidate_another_source_proposed_is_not_counted():
    # The drafter proposes token 5 (rejected); retrieval's rank 0 repeats it, its rank 1 (6) is its own
    # node and is rejected too. Only the own node counts for retrieval: position 0 learns nothing.
    source, draft = adjacency((2,)), DraftRates(None, "cpu")
    for _ in range(20):
        built = tree(([5], [-1], [-0.1], [1]), [5, 6], [-1, -1], [RETRIEVAL] * 2, 4,
                     draft.values(torch.tensor([-0.1])), source.rates.rate().log())
        assert built.source[0].tolist()[:3] == [ROOT, DRAFT, RETRIEVAL] and built.cand_node.tolist() == [[1, 2]]
        source.observe(built, on_path_mask(torch.tensor([[0, -1, -1, -1]])), built.cand_node, None)
    assert source.rates.n[0] == 0 and source.rates.n[1] > 5 and source.rates.acc.sum() == 0


def test_a_candidate_whose_drafted_sibling_was_accepted_is_not_counted():
    # Children of one node are exclusive: when the drafted 5 is accepted, retrieval's 6 beside it
    # had no chance, and its rate is P(accepted | parent accepted, no drafted sibling accepted).
    # Its chain beneath the drafted node (7 under 5) was tried, and is counted.
    source, draft = adjacency((2, 1)), DraftRates(None, "cpu")
    built = tree(([5], [-1], [-0.1], [1]), [5, 6, 7], [-1, -1, 0], [RETRIEVAL] * 3, 4,
                 draft.values(torch.tensor([-0.1])), source.rates.rate().log())
    assert built.tokens.tolist() == [[0, 5, 6, 7]] and built.source[0, 1] == DRAFT
    source.observe(built, on_path_mask(torch.tensor([[0, 1, 3, -1]])), built.cand_node, None)
    assert source.rates.n.tolist() == [0.0, 0.0, 1.0] and source.rates.acc.tolist() == [0.0, 0.0, 1.0]


def test_counts_decay_so_a_change_of_workload_is_followed():
    source = adjacency()
    for _ in range(40):
        _step(source, [5, 6, 7, 8], accepted_depth=2)
    for _ in range(40):
        _step(source, [5, 6, 7, 8], accepted_depth=0)    # the workload changes: nothing accepted
    assert source.rates.rate()[0] < 0.35


def test_drafted_and_prompt_lookup_counts():
    draft, pld = DraftRates(None, "cpu"), lookup()
    # root, two drafted nodes (scores -0.1, -3.5), a prompt-lookup chain of 3 whose last token is missing
    built = tree(([2, 3], [-1, -1], [-0.1, -3.5], [1, 1]), [4, 5, -1], [-1, 0, 1], [PROMPT_LOOKUP] * 3, 5, root=1)
    assert built.tokens.tolist() == [[1, 2, 3, 4, 5]]
    on_path = on_path_mask(torch.tensor([[0, 3, 4, -1, -1]]))   # the chain is accepted; no drafted node is
    draft.observe(built, on_path)
    pld.observe(built, on_path, built.cand_node, torch.tensor([2]))
    hi, lo = (int(torch.bucketize(torch.tensor(s), torch.tensor(SCORE_EDGES))) for s in (-0.1, -3.5))
    assert draft.n[hi] == 1 and draft.n[lo] == 1 and draft.acc.sum() == 0
    # a 2-token match (the longest looked up here): both tried positions stand on the 2-gram class
    assert pld.rates.n.tolist() == [0, 2] and pld.rates.acc.tolist() == [0, 2]
    # the estimate moved towards the observations by 2 / (2 + PRIOR_WEIGHT)
    assert pld.rates.rate()[1] == pytest.approx((2 + PRIOR_WEIGHT * 0.5) / (2 + PRIOR_WEIGHT))


def test_prompt_lookup_values_follow_the_matched_ngram():
    pld = lookup(pld_tokens=2, pld_max_ngram=2)
    context = torch.tensor([[5, 6, 7, 5, 6, -1], [1, 2, 3, 4, 5, 6]])
    from graft_tk.sources import StepView
    cand = pld.propose(StepView(torch.tensor([6, 6]), context, torch.tensor([5, 6])))
    assert cand.tokens.tolist() == [[7, 5], [-1, -1]] and cand.note.tolist() == [2, 0]
    assert torch.allclose(cand.values.exp(), torch.tensor([[0.5, 0.5], [0.3, 0.3]]))


def test_a_chain_position_is_valued_by_the_match_it_extends():
    """Matched lengths share a rate by class (1, 2, 3, 4-7, 8-15, 16+): a 16-token match starts
    near-sure, a 1-token one doubtful. Position d of a chain found by a g-token match stands on an
    effective match of g + d (its d predecessors accepted), so a chain from a 1-token match is
    doubtful at first and a copy deeper down, and what it shows there values every chain."""
    pld = lookup(pld_tokens=12, pld_max_ngram=16)
    assert pld.rates.rate().shape == (6,)
    assert pld._cells(torch.tensor([1]))[0].tolist() == [0, 1, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4]
    assert pld._cells(torch.tensor([0, 16])).tolist() == [[0, 0, 1, 2, 3, 3, 3, 3, 4, 4, 4, 4], [5] * 12]
    rate = pld.rates.rate()
    assert rate[5] > 0.9 and rate[0] < 0.5
    # one step after a 1-token match: positions 0-4 accepted, the sixth rejected
    chain = list(range(20, 32))
    built = tree(cand=chain, cand_parents=pld.parents.tolist(), cand_source=[PROMPT_LOOKUP] * 12, budget=13,
                 cand_values=pld.rates.rate().log()[pld._cells(torch.tensor([1]))[0]])
    path = torch.full((1, 13), -1, dtype=torch.long)
    path[0, :6] = torch.tensor([0] + [int(built.cand_node[0, i]) for i in range(5)])
    before = pld.rates.rate()
    pld.observe(built, on_path_mask(path), built.cand_node, torch.tensor([1]))
    assert pld.rates.n.tolist()[:5] == [1, 1, 1, 3, 0]      # effective lengths 1, 2, 3, 4-7 (3 tried)
    assert pld.rates.acc.tolist()[:5] == [1, 1, 1, 2, 0]
    # the 4-7 class learnt from this chain values the fourth position of every chain at once
    after = pld.propose(StepView(torch.tensor([9]), torch.tensor([[1, 2, 3, 9, 4, 5, 6, 9]]), torch.tensor([8])))
    assert after.note.tolist() == [1] and after.values[0, 3].exp() == pytest.approx(float(pld.rates.rate()[3]))
    assert pld.rates.rate()[3] != before[3]
