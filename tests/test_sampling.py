"""The top-p nucleus without a full sort: the same set as a stable full sort, ties by token id."""
import pytest
import torch

from graft_tk.sampling import NUCLEUS_TOPK, target_probs, truncated_probs


def nucleus_by_full_sort(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The definition: sort every row stably (probability desc, token id asc), keep a token while
    the mass before it is < top_p."""
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_sorted)


@pytest.mark.parametrize("vocab", [5, 64, 65, 3000])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_nucleus_equals_the_full_sort_definition(vocab, top_p):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=g) * torch.tensor([0.01, 0.3, 1, 3, 8, 30] * 2)[:, None]
    logits[6] = 0.0                               # a flat row: its nucleus is wider than the top 64
    logits[7, :10] = logits[7].max() + 1          # a tie of ten at the top, cut in the middle by small top_p
    logits[8, 3::7] = 2.5                         # ties scattered through the vocabulary
    got = truncated_probs(logits, 0.7, top_p)
    want = nucleus_by_full_sort(logits, 0.7, top_p)
    assert torch.equal(got > 0, want)
    probs = torch.softmax(logits / 0.7, -1)
    assert torch.equal(got, torch.where(want, probs, 0.0))          # kept tokens keep their exact probability
    assert torch.allclose(target_probs(logits, 0.7, top_p).sum(-1), torch.ones(12))


def test_ties_at_the_boundary_keep_the_lowest_token_ids():
    logits = torch.zeros(1, 10)
    logits[0, [2, 5, 7]] = 1.0                    # three equal tokens at the top; each holds ~0.21 of the mass
    p = torch.softmax(logits, -1)[0, 2]
    got = truncated_probs(logits, 1.0, float(p) * 1.5)   # needs two of the three
    assert (got[0] > 0).nonzero().flatten().tolist() == [2, 5]


def test_a_row_alone_gives_the_same_bits_as_in_a_batch():
    # accept's torch walk computes single rows, the Triton path all rows at once
    logits = torch.randn(16, 151936, generator=torch.Generator().manual_seed(0)) * 4
    batch = truncated_probs(logits, 0.7, 0.9)
    for i in (0, 5, 15):
        assert torch.equal(truncated_probs(logits[i:i + 1], 0.7, 0.9)[0], batch[i])


def test_top_p_one_is_the_softmax():
    logits = torch.randn(3, 100)
    assert torch.equal(truncated_probs(logits, 0.5, 1.0), torch.softmax(logits / 0.5, -1))
    assert NUCLEUS_TOPK >= 1
