"""draft_expand: Triton kernel (compiled on CUDA, interpreted on CPU) vs torch reference, and the
reference's tie order. Inputs are drawn on CPU (seeded: the same values everywhere) and moved to
DEVICE; kernel and reference get the same device tensors.

Integer outputs (tokens, parents, next frontier, stop) must be equal; scores within KERNEL_TOL.
The kernel's log-sum-exp is summed in a different order than ATen's, so scores differ by ulps:
which tokens are picked never depends on that (ranked on raw logits), the next frontier would only
at a near-tie of two children's scores across rows, which the seeded inputs avoid (random scores)
or make exact (identical rows: the same row gives bit-identical scores in either implementation).
"""
import math

import pytest
import torch

from graft_tk.kernels._common import multiprocessors
from graft_tk.kernels.draft_expand import _config, _expand, vocab_chunks
from graft_tk.kernels.draft_expand import draft_expand as draft_expand_kernel
from graft_tk.reference.draft_expand import desc_key, draft_expand, key_index, top_k_lowest_index
from tests.kernel_utils import DEVICE, counted, on_device
from tests.tolerances import KERNEL_TOL


def run_both(frontier_scores, logits, top_k, log_tau, chunks=None):
    """The kernel (``chunks``: its vocabulary split over that many stage-1 programs; None = what
    the launcher picks: one fused launch off a GPU) against the reference, on a batch of two rows:
    the given frontier [F] / logits [F, V] / log_tau, and a second row of other logits (the first
    row's, reversed along the vocabulary) under a threshold that never stops. Returns row 0's
    outputs, unbatched (child_parents is every row's)."""
    F, V = logits.shape
    batch_logits = torch.stack([logits, logits.flip(-1)])
    batch_scores = torch.stack([frontier_scores, frontier_scores - 0.5])
    batch_tau = torch.tensor([log_tau, -math.inf], device=logits.device)
    config = _config(F, V, top_k)
    asked = chunks or vocab_chunks(V, config["BLOCK_V"], multiprocessors(logits.device))
    width = -(-(-(-V // asked)) // config["BLOCK_V"]) * config["BLOCK_V"]     # whole tiles per chunk
    launches = 1 + (-(-V // width) > 1)                                        # stage 1 only with > 1 chunk
    with counted() as c:
        if chunks is None:
            got = draft_expand_kernel(batch_scores, batch_logits, top_k, batch_tau)
        else:
            got = _expand(batch_scores, batch_logits, top_k, batch_tau, config, chunks)
    assert sum(c.launches.values()) == launches                               # both rows in the same launches
    want = draft_expand(batch_scores, batch_logits, top_k, batch_tau)
    names = ("child_tokens", "child_parents", "child_scores", "next_frontier", "stop")
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        if g.dtype == torch.float32:
            atol, rtol = KERNEL_TOL[torch.float32]
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=name)
        else:
            assert torch.equal(g, w), f"{name}: kernel {g.tolist()} != reference {w.tolist()}"
    return tuple(g if name == "child_parents" else g[0] for name, g in zip(names, got))


def inputs(F, V, seed, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return on_device(-torch.rand(F, generator=g) * 4, (torch.randn(F, V, generator=g) * scale).to(dtype))


@pytest.mark.parametrize("F,V,K", [
    (1, 151936, 16),    # Qwen root: one row (padded to 2), 75 tiles of 2048, the last 384 wide
    (16, 151936, 16),   # Qwen full frontier: 594 tiles of 16 x 256 (slowest case, ~4 s interpreted)
    (8, 49152, 8),      # SmolLM2 frontier: 96 tiles of 8 x 512, V a multiple of the tile
    (4, 5000, 3),       # several tiles of 1024, the last 904 wide; K not a power of two
    (1, 100, 1),        # K = 1 (F = 1): a single child, next frontier of one; one partial tile
    (3, 7, 7),          # K = V: every token is a child; F not a power of two
    (5, 300, 16),       # K > F: 16 slots per row, rows padded 5 -> 8
])
def test_matches_reference(F, V, K):
    cfg = _config(F, V, K)
    assert cfg["F_PAD"] * cfg["BLOCK_V"] <= 4096
    run_both(*inputs(F, V, seed=F * 1000 + K), K, math.log(0.05))


@pytest.mark.parametrize("F,V,K,chunks", [
    (1, 151936, 16, 19),   # Qwen root as a GPU splits it: 19 chunks of 8,192 columns, the last 4,480
    (16, 49152, 8, 12),    # a full SmolLM2 frontier over 12 programs
    (4, 5000, 3, 5),       # chunks of 1,024 (one tile each), the last 904 wide
    (3, 7, 7, 4),          # fewer columns than a tile: one chunk, the fused launch
])
def test_vocabulary_split_over_programs_matches_reference(F, V, K, chunks):
    run_both(*inputs(F, V, seed=F * 1000 + K + 1), K, math.log(0.05), chunks=chunks)


def test_split_chunk_narrower_than_k():
    # 16-column tiles: V = 35 in 3 chunks, the last with 3 columns < K = 8 (its sentinel keys must
    # not enter the merge); ties across chunks break to the lower token id.
    fs, logits = inputs(2, 35, seed=11)
    logits[0, 3] = logits[0, 20] = logits[0, 34] = 9.0
    tau = torch.tensor([-3.0], device=DEVICE)
    want = draft_expand(fs[None], logits[None], 8, tau)
    got = _expand(fs[None], logits[None], 8, tau, {**_config(2, 35, 8), "BLOCK_V": 16}, 3)
    for g, w in zip(got, want):
        assert torch.equal(g, w) if g.dtype != torch.float32 else torch.allclose(g, w, atol=1e-5)
    assert got[0][0, :3].tolist() == [3, 20, 34]


def test_vocab_chunks_heuristic():
    assert vocab_chunks(151936, 256, sms=132) == 132 and vocab_chunks(151936, 2048, sms=132) == 19
    assert vocab_chunks(151936, 256, sms=0) == 1 and vocab_chunks(3000, 1024, sms=132) == 1


def test_fp16_and_strided_logits():
    fs, logits = inputs(4, 3000, seed=3)
    wide = torch.zeros(4, 3100, device=DEVICE)
    wide[:, :3000] = logits
    run_both(fs, wide[:, :3000], 4, -3.0)                       # row stride 3100 != V
    run_both(fs, logits.half(), 4, -3.0)                        # fp16 logits, read as fp32


@pytest.mark.parametrize("F,V,K", [(4, 64, 4), (3, 2500, 8), (2, 9, 9)])
def test_ties(F, V, K):
    # Integer-valued logits: many equal logits per row (row top-K ties at the k-th value) and the
    # last row a copy of the first with the same frontier score (exactly tied children across rows).
    g = torch.Generator().manual_seed(V)
    logits = torch.randint(-2, 2, (F, V), generator=g).float()
    logits[-1] = logits[0]
    fs = torch.zeros(F)
    fs[-1] = fs[0] = -1.0
    fs, logits = on_device(fs, logits)
    got = run_both(fs, logits, K, -3.0)
    # The reference's order is the stable one: larger first, equal -> lower index first.
    want_tokens = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :K].reshape(-1)
    assert torch.equal(got[0], want_tokens)
    want_next = torch.sort(got[2], descending=True, stable=True).indices[:K]
    assert torch.equal(got[3], want_next)


def test_negative_infinity_logits():
    # A masked vocabulary: -inf logits, one row with fewer finite entries than K (its tail children
    # are -inf-scored ties, lowest token ids first), and -0.0 / +0.0 equal logits.
    fs, logits = inputs(3, 700, seed=5)
    logits[:, 100:] = float("-inf")
    logits[1, 2:] = float("-inf")
    logits[2] = -logits[2].abs() - 1.0
    logits[2, 10], logits[2, 11] = -0.0, 0.0                  # the row's two best, tied
    got = run_both(fs, logits, 5, -5.0)
    assert got[0][5:10].tolist()[:2] == torch.sort(logits[1], descending=True, stable=True).indices[:2].tolist()
    assert got[0][7:10].tolist() == [2, 3, 4] and torch.isneginf(got[2][7:10]).all()
    assert got[0][10:12].tolist() == [10, 11]


@pytest.mark.parametrize("log_tau,stop", [(-math.inf, False), (0.0, True), (-1e9, False)])
def test_stop_flag(log_tau, stop):
    # Frontier scores < 0 and log p <= 0: every child is < 0, so log_tau = 0 stops; -inf never does.
    got = run_both(*inputs(4, 1000, seed=7), 4, log_tau)
    assert bool(got[4]) is stop


def test_bad_arguments():
    fs, logits = inputs(2, 10, seed=0)
    fs, logits, tau = fs[None], logits[None], torch.zeros(1, device=DEVICE)
    for fn in (draft_expand, draft_expand_kernel):
        with pytest.raises(ValueError, match="top_k"):
            fn(fs, logits, 11, tau)
    with pytest.raises(ValueError, match="frontier_scores"):
        draft_expand_kernel(fs[:, :1], logits, 2, tau)
    with pytest.raises(ValueError, match="log_tau"):
        draft_expand_kernel(fs, logits, 2, torch.zeros(2, device=DEVICE))


# ------------------------------------------------------------------ the reference's tie order
def test_top_k_lowest_index_is_the_stable_order():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        F, V = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 50, (1,), generator=g))
        K = int(torch.randint(1, V + 1, (1,), generator=g))
        x = torch.randint(-3, 3, (F, V), generator=g).float() if trial % 2 else torch.randn(F, V, generator=g)
        x[torch.rand(F, V, generator=g) < 0.2] = float("-inf")
        x[torch.rand(F, V, generator=g) < 0.1] = -0.0
        x = on_device(x)                       # drawn on CPU; the reference runs on DEVICE too
        want = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :K]
        assert torch.equal(top_k_lowest_index(x, K), want)
        assert torch.equal(key_index(desc_key(x, torch.arange(V, device=DEVICE)).topk(K, dim=-1).values), want)
