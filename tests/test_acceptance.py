"""The online acceptance estimates the budget allocator ranks candidates by."""
import math

import numpy as np
import pytest
import torch

from graft_tk.acceptance import PRIOR_WEIGHT, SCORE_EDGES, AcceptanceEstimates, isotonic_fit
from graft_tk.calibration.warm_start import isotonic_increasing
from graft_tk.adjacency import RetrievalTemplate, template_from_level_sizes
from graft_tk.reference.build_tree import build_tree
from graft_tk.tree import DRAFT, PROMPT_LOOKUP, RETRIEVAL, ROOT


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


def estimates(template=None, pld_tokens=3, pld_max_ngram=2):
    template = template or template_from_level_sizes((2, 2), 2)
    return AcceptanceEstimates(template, pld_tokens, pld_max_ngram, "cpu")


def test_priors():
    est = estimates()
    # drafted: the drafter's own probability, non-decreasing in the score
    rates = est.draft_rates()
    assert (rates[1:] >= rates[:-1]).all() and rates[-1] > 0.8 and rates[0] < 0.01
    # retrieval, given the parent accepted: by rank (template: [r0, r1], then r0 and r1 under r0)
    assert torch.allclose(est.retrieval_values().exp(), torch.tensor([0.4, 0.24, 0.4, 0.24]))
    # prompt lookup, given the previous position accepted: a longer match is likelier
    assert torch.allclose(est.pld_values(1).exp(), torch.tensor([0.3, 0.3, 0.3]))
    assert torch.allclose(est.pld_values(2).exp(), torch.tensor([0.5, 0.5, 0.5]))


def _step(est, template, retrieved, accepted_depth):
    """One step of a retrieval-only tree: accept the rank-0 chain down to ``accepted_depth``."""
    cand_parents = template.parents.to(torch.int32)
    built = build_tree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0),
                       torch.zeros(0, dtype=torch.long), 0, torch.tensor(0), 0.0, retrieved, cand_parents,
                       torch.full((template.n,), RETRIEVAL, dtype=torch.int8), 8, None, est.retrieval_values())
    n = int(built.n_nodes)
    # nodes of the rank-0 chain: template 0, then its rank-0 child (template node 2)
    chain = [0] + [int(built.cand_node[i]) for i in (0, 2)][:accepted_depth]
    path = torch.full((n,), -1, dtype=torch.long)
    path[:len(chain)] = torch.tensor(chain)
    est.update(built, path, None, 0, (0, template.n))
    return built


def test_retrieval_estimates_learn_which_positions_are_accepted():
    template = template_from_level_sizes((2, 2), 2)        # [r0, r1] at depth 1, r0 and r1 under r0 at depth 2
    est = estimates(template)
    retrieved = torch.tensor([5, 6, 7, 8])
    for _ in range(30):
        _step(est, template, retrieved, accepted_depth=2)
    rate = est.retrieval_values().exp()
    # r0 and its rank-0 child: always accepted once tried -> close to 1; r1 never -> close to 0
    assert rate[0] > 0.9 and rate[2] > 0.85 and rate[1] < 0.1 and rate[3] < 0.1
    # the tree's values are the paths': r0 -> its child multiplies the two
    built = _step(est, template, retrieved, accepted_depth=2)
    assert AcceptanceEstimates.node_probs(built)[built.cand_node[2]] == pytest.approx(float(rate[0] * rate[2]), rel=0.05)


def test_a_candidate_another_source_proposed_is_not_counted():
    # The drafter proposes token 5 (accepted); retrieval's rank 0 repeats it, its rank 1 (6) is its own
    # node and is rejected. Only the own node counts for retrieval: position 0 learns nothing.
    template = template_from_level_sizes((2,), 2)
    est = estimates(template)
    for _ in range(20):
        built = build_tree(torch.tensor([5]), torch.tensor([-1]), torch.tensor([-0.1]), torch.tensor([1]), 1,
                           torch.tensor(0), -math.inf, torch.tensor([5, 6]), template.parents.to(torch.int32),
                           torch.full((2,), RETRIEVAL, dtype=torch.int8), 4, est.draft_values(torch.tensor([-0.1])),
                           est.retrieval_values())
        assert built.source.tolist()[:3] == [ROOT, DRAFT, RETRIEVAL] and built.cand_node.tolist() == [1, 2]
        est.update(built, torch.tensor([0, 1, -1, -1]), None, None, (0, 2))
    assert est.retrieval_n[0] == 0 and est.retrieval_n[1] > 5 and est.retrieval_acc.sum() == 0


def test_counts_decay_so_a_change_of_workload_is_followed():
    template = template_from_level_sizes((2, 2), 2)
    est = estimates(template)
    retrieved = torch.tensor([5, 6, 7, 8])
    for _ in range(40):
        _step(est, template, retrieved, accepted_depth=2)
    for _ in range(40):
        _step(est, template, retrieved, accepted_depth=0)    # the workload changes: nothing accepted
    assert est.retrieval_values().exp()[0] < 0.35


def test_drafted_and_prompt_lookup_counts():
    est = estimates()
    # root, two drafted nodes (scores -0.1, -3.5), a prompt-lookup chain of 3 whose last token is missing
    pool_tokens, pool_parents = torch.tensor([2, 3]), torch.tensor([-1, -1])
    built = build_tree(pool_tokens, pool_parents, torch.tensor([-0.1, -3.5]), torch.tensor([1, 1]), 2,
                       torch.tensor(1), -math.inf, torch.tensor([4, 5, -1]), torch.tensor([-1, 0, 1], dtype=torch.int32),
                       torch.full((3,), PROMPT_LOOKUP, dtype=torch.int8), 5)
    assert built.tokens.tolist() == [1, 2, 3, 4, 5]
    path = torch.tensor([0, 3, 4, -1, -1])                 # the chain is accepted; no drafted node is
    est.update(built, path, (0, 3), 2, None)
    hi, lo = (int(torch.bucketize(torch.tensor(s), torch.tensor(SCORE_EDGES))) for s in (-0.1, -3.5))
    assert est.draft_n[hi] == 1 and est.draft_n[lo] == 1 and est.draft_acc.sum() == 0
    assert est.pld_n[1].tolist() == [1, 1, 0] and est.pld_acc[1].tolist() == [1, 1, 0]
    assert est.pld_n[0].sum() == 0
    # the estimate moved towards the observation by 1 / (1 + PRIOR_WEIGHT)
    assert est.pld_values(2).exp()[0] == (1 + PRIOR_WEIGHT * 0.5) / (1 + PRIOR_WEIGHT)


def test_summary_is_plain_numbers():
    s = estimates(RetrievalTemplate(torch.tensor([-1]), torch.tensor([0]), 1)).summary()
    assert set(s) == {"draft_by_score_bucket", "retrieval_by_position", "pld_by_ngram"}
    assert all(isinstance(x, float) for x in s["draft_by_score_bucket"])
