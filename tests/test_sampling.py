"""The top-p nucleus without a full sort: the same set as a stable full sort, ties by token id."""
import pytest
import torch

from graft_tk.errors import InputError
from graft_tk.sampling import NUCLEUS_TOPK, Sampling, choose, position_uniforms, target_probs, truncated_probs


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
    logits = torch.randn(16, 151936, generator=torch.Generator().manual_seed(0)) * 4
    batch = truncated_probs(logits, 0.7, 0.9)
    for i in (0, 5, 15):
        assert torch.equal(truncated_probs(logits[i:i + 1], 0.7, 0.9)[0], batch[i])


def test_top_p_one_is_the_softmax():
    logits = torch.randn(3, 100)
    assert torch.equal(truncated_probs(logits, 0.5, 1.0), torch.softmax(logits / 0.5, -1))
    assert NUCLEUS_TOPK >= 1


# ---------------------------------------------------------------- the seeded draw per position
def _splitmix_uniform(key: int, position: int) -> float:
    """position_uniforms in plain Python integers (mod 2**64): the definition the tensors follow."""
    M = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        return z ^ (z >> 31)
    z = mix((mix((position * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & M) ^ (key & M)) & M)
    return ((z >> 11) + 0.5) * 2.0 ** -53


def test_position_uniforms_are_a_fixed_function_of_seed_and_position():
    keys = [0, 1, 12345, Sampling(1.0, 1.0, 2 ** 63 + 7).key, Sampling(1.0, 1.0, -5).key]
    positions = [0, 1, 17, 4096, 10 ** 9]
    got = position_uniforms(torch.tensor(keys)[:, None], torch.tensor(positions)[None])
    want = [[_splitmix_uniform(k, p) for p in positions] for k in keys]
    assert got.dtype == torch.float64 and got.tolist() == want
    assert 0.0 < float(got.min()) and float(got.max()) < 1.0


def test_the_draw_follows_the_target_distribution_and_depends_only_on_seed_and_position():
    """20,000 positions of one seed, logits fixed: the draws follow softmax(l / T) cut to top_p
    (chi-square); the same (seed, position) gives the same token in any row and batch shape."""
    from .chi2 import chi2, chi2_critical
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    positions = torch.arange(n)[None]
    rows = logits.expand(1, n, 6)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.8)):
        draws = choose(rows, positions, [Sampling(temperature, top_p, 42)])[0]
        stat, df = chi2(torch.bincount(draws, minlength=6).float(), target_probs(logits, temperature, top_p))
        assert stat < chi2_critical(df), (temperature, top_p, stat)
        pair = choose(logits.expand(2, 3, 6), torch.tensor([[5, 9, 11], [9, 5, 11]]),
                      [Sampling(temperature, top_p, 42), Sampling(temperature, top_p, 42)])
        assert pair[0, 0] == draws[5] and pair[1, 0] == draws[9] and pair[0, 2] == pair[1, 2] == draws[11]


def test_greedy_rows_and_tiny_temperatures_take_the_argmax():
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(1))
    got = choose(logits, torch.zeros(3, 4, dtype=torch.long),
                 [Sampling(), Sampling(1e-30, 1.0, 3), Sampling(1.0, 1.0, 3)])
    assert torch.equal(got[:2], logits[:2].argmax(-1))
    with pytest.raises(InputError, match="seed must be"):
        Sampling(1.0, 1.0, 2 ** 64)
    with pytest.raises(InputError, match="temperature must be"):
        Sampling(-1.0)
