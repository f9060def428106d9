"""Retrieval kernel vs the torch reference: every template level in one launch, exact tokens.

Inputs are drawn on CPU (seeded: the same values everywhere) and moved to DEVICE (CUDA: compiled
kernels; CPU: Triton's interpreter); kernel and reference get the same device tensors."""
import pytest
import torch

from tests.kernel_utils import DEVICE, counted, on_device  # (imports graft_tk.kernels first: interpreter on CPU)
from graft_tk.adjacency import RetrievalTemplate, template_from_level_sizes
from graft_tk.kernels.retrieve import retrieve as retrieve_kernel
from graft_tk.reference.retrieve import retrieve


def random_adjacency(vocab: int, k: int, seed: int, empty_rows: float = 0.3, empty_cols: float = 0.2) -> torch.Tensor:
    """int32 [vocab, k] on DEVICE with whole rows never written (-1) and scattered empty entries
    (-1); drawn on CPU, so the same values on every machine."""
    g = torch.Generator().manual_seed(seed)
    adj = torch.randint(0, vocab, (vocab, k), generator=g, dtype=torch.int32)
    adj[torch.rand(vocab, generator=g) < empty_rows] = -1
    adj[torch.rand(vocab, k, generator=g) < empty_cols] = -1
    return adj.to(DEVICE)


TEMPLATES = {
    # the 80-node default (6 levels, one program of BLOCK_T = 128)
    "default-80": ((8, 21, 25, 15, 8, 3), 8),
    # a single node: T = 1, one gather
    "one-node": ((1,), 4),
    # k = 1: a chain, every node at its own depth (depth 7 = 7 dependent gathers)
    "chain-k1": ((1, 1, 1, 1, 1, 1, 1), 1),
    # 200 nodes: BLOCK_T caps at 128, so two programs
    "wide-200": ((16, 64, 120), 16),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("vocab", [37, 1000])   # neither is a multiple of any block size
def test_matches_reference(name, vocab):
    sizes, k = TEMPLATES[name]
    template = template_from_level_sizes(sizes, k).to(DEVICE)
    for seed in range(4):
        adj = random_adjacency(vocab, k, seed)
        g = torch.Generator().manual_seed(100 + seed)
        roots = on_device(torch.randint(vocab, (3,), generator=g))   # a batch of three rows
        with counted() as c:
            out = retrieve_kernel(adj, roots, template)
        assert sum(c.launches.values()) == 1                          # every row, all levels, one launch
        assert out.dtype == torch.int64 and out.shape == (3, template.n)
        assert torch.equal(out, retrieve(adj, roots, template)), (name, vocab, seed)
        for b in range(3):                                             # a row alone gives its row
            assert torch.equal(retrieve_kernel(adj, roots[b:b + 1], template)[0], out[b])


def test_root_with_empty_row_gives_all_minus_one():
    template = template_from_level_sizes((8, 21, 25, 15, 8, 3), 8).to(DEVICE)
    adj = random_adjacency(100, 8, 0)
    adj[42] = -1
    root = torch.tensor([42], device=DEVICE)
    out = retrieve_kernel(adj, root, template)
    assert torch.equal(out, torch.full((1, 80), -1, device=DEVICE)) and torch.equal(out, retrieve(adj, root, template))


def test_missing_node_hides_its_subtree():
    # The reference's worked example: node 3 hits an empty column, node 4 an empty row.
    adj = torch.full((16, 2), -1, dtype=torch.int32, device=DEVICE)
    adj[5] = torch.tensor([7, 9], dtype=torch.int32, device=DEVICE)
    adj[7] = torch.tensor([3, -1], dtype=torch.int32, device=DEVICE)
    template = RetrievalTemplate(torch.tensor([-1, -1, 0, 0, 1]), torch.tensor([0, 1, 0, 1, 0]), k=2).to(DEVICE)
    root = torch.tensor([5], device=DEVICE)
    assert torch.equal(retrieve_kernel(adj, root, template), on_device(torch.tensor([[7, 9, 3, -1, -1]])))
    # A deeper template under the missing node: its whole subtree stays -1 even where M has rows.
    adj[3] = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    adj[0] = torch.tensor([4, 4], dtype=torch.int32, device=DEVICE)   # row 0: must not be read through a clamped -1
    deep = RetrievalTemplate(torch.tensor([-1, -1, 0, 0, 1, 2, 3, 4]), torch.tensor([0, 1, 0, 1, 0, 0, 0, 0]),
                             k=2).to(DEVICE)
    expected = on_device(torch.tensor([[7, 9, 3, -1, -1, 1, -1, -1]]))
    assert torch.equal(retrieve(adj, root, deep), expected)
    assert torch.equal(retrieve_kernel(adj, root, deep), expected)


def test_wider_adjacency_than_template():
    # adj has k = 8 columns, the template reads only 3 (strides, not k, address M).
    template = template_from_level_sizes((3, 6, 4), 3).to(DEVICE)
    adj = random_adjacency(50, 8, 3)
    root = torch.tensor([7, 3], device=DEVICE)
    assert torch.equal(retrieve_kernel(adj, root, template), retrieve(adj, root, template))
    # a non-contiguous view of M (every other column) works the same
    wide = random_adjacency(50, 6, 4)[:, ::2]
    assert torch.equal(retrieve_kernel(wide, root, template), retrieve(wide, root, template))


def test_empty_template_needs_no_launch():
    empty = RetrievalTemplate(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), k=2).to(DEVICE)
    with counted() as c:
        out = retrieve_kernel(random_adjacency(10, 2, 0), torch.tensor([1], device=DEVICE), empty)
    assert out.shape == (1, 0) and not c.launches


def test_bad_input_is_a_clear_error():
    template = template_from_level_sizes((2, 2), 2).to(DEVICE)
    one, two = torch.tensor([1], device=DEVICE), torch.tensor([[1, 2]], device=DEVICE)
    with pytest.raises(ValueError, match="adj has only"):
        retrieve_kernel(random_adjacency(10, 1, 0), one, template)
    with pytest.raises(ValueError, match="int32"):
        retrieve_kernel(random_adjacency(10, 2, 0).long(), one, template)
    with pytest.raises(ValueError, match=r"roots must be \[B\]"):
        retrieve_kernel(random_adjacency(10, 2, 0), two, template)


def test_rank_paths_are_cached_on_the_template():
    # CPU only: a fact about the template's host-side construction and .to(); no kernel runs.
    t = RetrievalTemplate(torch.tensor([-1, -1, 0, 2]), torch.tensor([0, 1, 1, 0]), k=2)
    assert torch.equal(t.rank_paths, torch.tensor([[0, -1, -1], [1, -1, -1], [0, 1, -1], [0, 1, 0]],
                                                  dtype=torch.int32))
    assert torch.equal(t.to("cpu").rank_paths, t.rank_paths)
