"""KV commit kernel vs the torch reference: overlapping moves, all layers in one launch, exact bits.

Caches are drawn on CPU (seeded: the same values everywhere) and moved to DEVICE (CUDA: compiled
kernels; CPU: Triton's interpreter); slot tensors go to DEVICE too."""
import pytest
import torch

from tests.kernel_utils import DEVICE, counted, on_device  # (imports graft_tk.kernels first: interpreter on CPU)
from graft_tk.kernels.commit_kv import commit_kv as commit_kernel
from graft_tk.reference.commit_kv import commit_kv as commit_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_kv(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def check(kv, src, dst, launches=1):
    """Kernel vs reference: ``src`` [B, n] or [n] (every row alike), ``dst`` [B] or an int."""
    B = kv.shape[2]
    src = src.expand(B, -1) if src.dim() == 1 else src
    dst = torch.full((B,), dst, device=DEVICE) if isinstance(dst, int) else dst
    expected = kv.clone()
    commit_reference(expected, src, dst)
    with counted() as c:
        commit_kernel(kv, src, dst)
    assert sum(c.launches.values()) == launches
    # compare bits: copies must be exact for every dtype (NaN-safe, -0.0-safe)
    assert torch.equal(kv.view(torch.int16 if kv.element_size() == 2 else torch.int32),
                       expected.view(torch.int16 if kv.element_size() == 2 else torch.int32))


CASES = {
    # accepted path [0, 2, 3] of a tree after a 7-token prefix: src and dst overlap, slot 9 is
    # read for row 1 and written by row 2
    "overlap": ([7, 9, 10], 7),
    # a longer path with gaps: each dst slot is some later row's src
    "overlap-long": ([5, 6, 8, 9, 11, 14], 5),
    # the root alone: a move onto itself
    "n1-self": ([7], 7),
    "n1-move": ([12], 7),
    # sources below the destination (not the engine's case, still defined): reads of rows already
    # moved by the reference would be stale
    "backward": ([0, 1, 2, 3, 4], 2),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype):
    src, dst = CASES[case]
    kv = random_kv((3, 2, 1, 2, 16, 32), dtype, seed=len(src))   # L=3, B=1, H=2, S=16, D=32
    check(kv, torch.tensor(src, device=DEVICE), dst)


@pytest.mark.parametrize("head_dim", [24, 1, 200])   # not powers of two; 200 > the 128-wide D block
def test_head_dim_not_a_power_of_two(head_dim):
    kv = random_kv((2, 2, 2, 3, 12, head_dim), torch.float16, seed=head_dim)   # batch 2
    check(kv, torch.tensor([4, 6, 7, 10], device=DEVICE), 4)


def test_many_slots_shrink_the_d_block():
    # n = 100 -> BLOCK_N = 128, BLOCK_D = 32: D = 64 is split over two programs per row
    kv = random_kv((1, 2, 1, 1, 256, 64), torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    src = 20 + torch.sort(torch.randperm(200, generator=g)[:100]).values
    check(kv, on_device(src), 20)


def test_n0_launches_nothing():
    kv = random_kv((2, 2, 1, 2, 8, 16), torch.float32, seed=0)
    before = kv.clone()
    check(kv, torch.zeros(0, dtype=torch.int64, device=DEVICE), 3, launches=0)
    assert torch.equal(kv, before)


def test_non_contiguous_cache_and_int32_slots():
    # a cache stored [L, 2, B, S, H, D] and viewed as [L, 2, B, H, S, D]: strides, not shapes, address it
    base = random_kv((2, 2, 1, 16, 4, 8), torch.bfloat16, seed=3)
    kv = base.transpose(3, 4)
    check(kv, torch.tensor([3, 5, 6], dtype=torch.int32, device=DEVICE), 3)


def test_rows_move_their_own_paths():
    # a batch of three rows, each with its own prefix length and accepted path (a batched step)
    kv = random_kv((2, 2, 3, 2, 24, 16), torch.bfloat16, seed=5)
    src = torch.tensor([[7, 9, 10, 11], [3, 4, 8, 5], [12, 13, 14, 15]], device=DEVICE)
    check(kv, src, torch.tensor([7, 3, 12], device=DEVICE))


def test_bad_input_is_a_clear_error():
    kv = random_kv((1, 2, 1, 1, 8, 4), torch.float32, seed=0)
    one = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match=r"\[L, 2, B, H, S, D\]"):
        commit_kernel(kv[0], torch.tensor([[0]], device=DEVICE), one)
    with pytest.raises(ValueError, match="integer tensor \\[B=1, n\\]"):
        commit_kernel(kv, torch.tensor([[0.0]], device=DEVICE), one)
    with pytest.raises(ValueError, match="dst must be an integer tensor \\[B=1\\]"):
        commit_kernel(kv, torch.tensor([[1, 2]], device=DEVICE), torch.tensor(3, device=DEVICE))
