"""Tree attention: the Triton kernel against the torch reference, metamorphic checks, and the
model giving the same logits on the "triton" attention backend as on "torch".

Runs compiled on CUDA when there is a GPU, else on CPU under TRITON_INTERPRET=1 (set by
graft_tk.kernels): shapes stay small. Inputs are drawn on CPU (the same values everywhere) and
moved to DEVICE; kernel and reference get the same device tensors. The kernel's
heuristic tiles are BLOCK_N = 64 keys and BLOCK_M = next_pow2(group * T) rows in [16, 64], so the
shapes below are chosen around 64.
"""
import pytest
import torch
import torch.nn.functional as F

from graft_tk.kernels.tree_attention import _launch, block_sizes, kv_splits
from graft_tk.kernels.tree_attention import tree_attention as tree_attention_triton
from graft_tk.models.attention import AttentionPlan
from graft_tk.models.transformer import ModelConfig, Transformer
from graft_tk.ops import ops_for
from graft_tk.reference.tree_attention import tree_attention as tree_attention_torch
from graft_tk.tree import Tree

from .kernel_utils import DEVICE, counted, on_device, random_tree
from .tolerances import KERNEL_TOL

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(B, Hq, Hkv, T, D, S, dtype, seed):
    g = torch.Generator().manual_seed(seed)   # CPU generator, then DEVICE: the same values everywhere
    # q as a transposed view, as the model's rotary output is: the kernel must honour strides.
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    return (q, *on_device(k, v))


def _assert_close(got, want, dtype):
    atol, rtol = KERNEL_TOL[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def _tree_mask(T, seed):
    return random_tree(T, seed=seed, device=DEVICE).attn_mask()


def _plan(prefixes, T, kind, seed):
    """(prefix [B], block [B, T, T] or None, keys) for rows with these prefix lengths: each row its
    own tree (``kind`` "tree"), an all-visible block ("ones"), a lower-triangular one ("causal")
    or the causal fast path ("none")."""
    B = len(prefixes)
    blocks = {"ones": lambda b: torch.ones(T, T, dtype=torch.bool, device=DEVICE),
              "causal": lambda b: torch.ones(T, T, dtype=torch.bool, device=DEVICE).tril(),
              "tree": lambda b: _tree_mask(T, seed=seed + b), "none": None}[kind]
    block = None if blocks is None else torch.stack([blocks(b) for b in range(B)])
    return torch.tensor(prefixes, device=DEVICE), block, max(prefixes) + T


# (name, Hq, Hkv, T, D, prefix of each row, block kind) — each names the code path it hits.
CASES = [
    # T = 1 decode, group 4: 4 rows in one 16-row block; prefix 70 = one full block + a 6-key tail.
    ("decode-gqa4", 8, 2, 1, 64, (70, 3), "ones"),
    # tree verify, T = 13 (not a power of two), no GQA, D = 128; kv_len 113: 1 full block + masked tail.
    ("tree-t13-d128", 2, 2, 13, 128, (100,), "tree"),
    # prefix 0: no full block, every key goes through the masked loop.
    ("tree-prefix0", 4, 1, 11, 64, (0,), "tree"),
    # Qwen2.5-1.5B's 12:2 heads (group 6): 6 * 9 = 54 rows in one 64-row block.
    ("tree-gqa6-qwen", 12, 2, 9, 128, (37,), "tree"),
    # a batch of four trees over ragged prefixes (a batched verify): each row stops at its own keys.
    ("tree-batch4-ragged", 12, 2, 9, 64, (37, 130, 0, 64), "tree"),
    # group 7 (7:1): 7 * 10 = 70 rows -> two 64-row blocks, the second mostly padding.
    ("tree-gqa7", 7, 1, 10, 64, (5,), "tree"),
    # prefix and kv_len multiples of BLOCK_N: two full blocks, then a masked block of exactly 64.
    ("aligned-blocks", 2, 1, 64, 64, (128,), "tree"),
    # causal prefill continuing a cache: lower-triangular mask, T = 33 spans a 64-key boundary.
    ("prefill-causal", 4, 2, 33, 64, (40,), "causal"),
    # the same as mask None: the causal fast path (no mask read, blocks above the diagonal skipped);
    # T = 70 rows in two 64-row blocks, the first of which stops at key prefix + 63.
    ("prefill-causal-none", 2, 2, 70, 32, (40,), "none"),
    ("prefill-causal-none-gqa3", 6, 2, 25, 64, (0, 17), "none"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name,Hq,Hkv,T,D,prefixes,kind", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_reference(name, Hq, Hkv, T, D, prefixes, kind, dtype):
    prefix, block, keys = _plan(prefixes, T, kind, seed=T)
    S = keys + 7  # a static cache longer than the keys read: keys past each row's must be ignored
    q, k, v = _inputs(len(prefixes), Hq, Hkv, T, D, S, dtype, seed=len(name))
    with counted() as c:
        got = tree_attention_triton(q, k, v, prefix, block, keys)
    assert sum(c.launches.values()) == 1          # one launch for every row of the batch
    _assert_close(got, tree_attention_torch(q, k, v, prefix, block, keys), dtype)
    if len(prefixes) > 1:   # each row equals its own attention alone: rows never mix
        for b in range(len(prefixes)):
            alone = tree_attention_torch(q[b:b + 1], k[b:b + 1], v[b:b + 1], prefix[b:b + 1],
                                         None if block is None else block[b:b + 1], prefixes[b] + T)
            _assert_close(got[b:b + 1], alone, dtype)


# (name, Hq, Hkv, T, D, prefixes, kind, splits): keys split over programs, then combined.
SPLIT_CASES = [
    # T = 1 decode, group 4, 300 keys in 4 splits of 128 (BLOCK_N 64 / 32): full and partial blocks per split.
    ("decode-4-splits", 8, 2, 1, 64, (299,), "ones", 4),
    # a tree whose masked block falls in the last split; 3 splits of a 2-batch cache.
    ("tree-3-splits", 6, 2, 9, 64, (200, 200), "tree", 3),
    # ragged rows: the short row's later splits are empty (weight 0 in the combine).
    ("tree-ragged-splits", 6, 2, 9, 64, (250, 20), "tree", 4),
    # more splits than blocks asked for: capped at one block per split, none empty.
    ("capped-splits", 2, 1, 5, 16, (60,), "tree", 16),
    # causal prefill split: later splits hold keys no row of a block sees (all-masked partials).
    ("causal-splits", 4, 2, 40, 32, (90,), "none", 4),
    # a row that sees no key in any split stays zeros.
    ("empty-row-splits", 2, 2, 70, 16, (0,), "empty-row", 2),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name,Hq,Hkv,T,D,prefixes,kind,splits", SPLIT_CASES, ids=[c[0] for c in SPLIT_CASES])
def test_split_kv_matches_reference(name, Hq, Hkv, T, D, prefixes, kind, splits, dtype):
    prefix, block, keys = _plan(prefixes, T, "causal" if kind == "empty-row" else kind, seed=T)
    if kind == "empty-row":
        block[:, 3] = False
    q, k, v = _inputs(len(prefixes), Hq, Hkv, T, D, keys + 3, dtype, seed=len(name))
    meta = {**block_sizes(Hq // Hkv * T, D, dtype), "KV_SPLITS": splits}
    got = torch.empty_like(q)
    with counted() as c:
        _launch(q, k, v, prefix, block, keys, 0.125, got, meta)
    assert sum(c.launches.values()) == 2         # the split kernel, then the combine
    _assert_close(got, tree_attention_torch(q, k, v, prefix, block, keys, 0.125), dtype)
    if kind == "empty-row":
        assert torch.equal(got[:, :, 3], torch.zeros_like(got[:, :, 3]))


def test_kv_splits_heuristic():
    # a Qwen2.5-1.5B decode step (2 programs) on 132 SMs: one split per 256 keys up to ~1 program per SM
    assert kv_splits(programs=2, kv_len=4096, sms=132) == 16
    assert kv_splits(programs=2, kv_len=100_000, sms=132) == 64          # capped at MAX_SPLITS... and SMs
    assert kv_splits(programs=12, kv_len=32768, sms=132) == 11
    assert kv_splits(programs=2, kv_len=300, sms=132) == 1               # too short to split
    assert kv_splits(programs=200, kv_len=32768, sms=132) == 1           # the launch fills the GPU (prefill)
    assert kv_splits(programs=2, kv_len=32768, sms=0) == 1               # no GPU: never split


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_row_without_visible_key_is_zero(dtype):
    """prefix 0 and an all-False row: zeros (SDPA would give NaN); other rows unaffected."""
    T = 6
    q, k, v = _inputs(1, 4, 2, T, 64, 10, dtype, seed=3)
    prefix, block, keys = _plan((0,), T, "causal", seed=0)
    block[0, 2] = False
    got = tree_attention_triton(q, k, v, prefix, block, keys)
    want = tree_attention_torch(q, k, v, prefix, block, keys)
    assert torch.equal(got[:, :, 2], torch.zeros_like(got[:, :, 2]))
    assert torch.equal(want[:, :, 2], torch.zeros_like(want[:, :, 2]))
    _assert_close(got, want, dtype)


def test_custom_scale():
    q, k, v = _inputs(1, 2, 2, 5, 64, 20, torch.float32, seed=4)
    prefix, block, keys = _plan((12,), 5, "tree", seed=4)
    _assert_close(tree_attention_triton(q, k, v, prefix, block, keys, scale=0.3),
                  tree_attention_torch(q, k, v, prefix, block, keys, scale=0.3), torch.float32)


@pytest.mark.parametrize("prefix_len", [0, 50])
def test_chain_tree_equals_causal_attention(prefix_len):
    """A chain-shaped tree (each node the child of the previous) is causal attention: compare with
    SDPA is_causal over all kv_len queries, keeping the last T rows."""
    T, Hq, Hkv, D = 21, 4, 2, 64
    chain = Tree.from_lists(list(range(T)), [-1] + list(range(T - 1)), device=DEVICE)
    kv_len = prefix_len + T
    q_all, k, v = _inputs(1, Hq, Hkv, kv_len, D, kv_len, torch.float32, seed=5)
    want = F.scaled_dot_product_attention(q_all, k, v, is_causal=True, enable_gqa=True)[:, :, prefix_len:]
    got = tree_attention_triton(q_all[:, :, prefix_len:], k, v, torch.tensor([prefix_len], device=DEVICE),
                                chain.attn_mask()[None], kv_len)
    _assert_close(got, want, torch.float32)


def test_reference_in_query_chunks_equals_sdpa(monkeypatch):
    """The torch reference (the CPU attention path) holds scores for a few queries at a time on a
    long prefill: with a chunk of 50 scores (one query row per chunk here) it still equals SDPA."""
    import graft_tk.reference.tree_attention as ref
    T, Hq, Hkv, D, prefix_len = 7, 4, 2, 16, 3
    q_all, k, v = _inputs(1, Hq, Hkv, prefix_len + T, D, prefix_len + T, torch.float32, seed=9)
    q_all, k, v = q_all.cpu(), k.cpu(), v.cpu()
    want = F.scaled_dot_product_attention(q_all, k, v, is_causal=True, enable_gqa=True)[:, :, prefix_len:]
    monkeypatch.setattr(ref, "_SCORES_PER_CHUNK", 50)
    for block in (None, torch.ones(1, T, T, dtype=torch.bool).tril()):
        torch.testing.assert_close(ref.tree_attention(q_all[:, :, prefix_len:], k, v, torch.tensor([prefix_len]),
                                                      block, prefix_len + T), want)


def test_permuting_nodes_permutes_outputs():
    """Relabel the tree's nodes by a permutation, moving queries, tree keys/values and mask rows and
    columns together: the outputs are permuted the same way."""
    T, P, Hq, Hkv, D = 19, 45, 4, 1, 64
    q, k, v = _inputs(1, Hq, Hkv, T, D, P + T, torch.float32, seed=6)
    prefix, block, keys = _plan((P,), T, "tree", seed=6)
    perm = on_device(torch.randperm(T, generator=torch.Generator().manual_seed(6)))
    slots = torch.cat([torch.arange(P, device=DEVICE), P + perm])
    got = tree_attention_triton(q[:, :, perm], k[:, :, slots], v[:, :, slots], prefix, block[:, perm][:, :, perm], keys)
    _assert_close(got, tree_attention_triton(q, k, v, prefix, block, keys)[:, :, perm], torch.float32)


def test_bad_arguments_raise():
    q, k, v = _inputs(1, 4, 2, 3, 64, 10, torch.float32, seed=7)
    prefix, block, _ = _plan((2,), 3, "ones", seed=0)
    with pytest.raises(ValueError, match="head dim 80"):
        tree_attention_triton(*_inputs(1, 4, 2, 3, 80, 10, torch.float32, seed=7), prefix, block, 5)
    with pytest.raises(ValueError, match="block must be bool"):
        tree_attention_triton(q, k, v, prefix, block[:, :2], 5)
    with pytest.raises(ValueError, match="prefix must be an int64 tensor"):
        tree_attention_triton(q, k, v, 2, block, 5)
    with pytest.raises(ValueError, match="must cover the block"):
        tree_attention_triton(q, k, v, prefix, block, 2)
    with pytest.raises(ValueError, match="fit the 10 cached keys"):
        tree_attention_triton(q, k, v, prefix, None, 11)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        tree_attention_triton(q[:, :3], k, v, prefix, block, 5)
    with pytest.raises(ValueError, match="one dtype"):
        tree_attention_triton(q.half(), k, v, prefix, block, 5)


def test_block_sizes_are_powers_of_two():
    for rows in (1, 6, 54, 70, 500):
        for d in (16, 64, 128, 256):
            for dtype in (torch.bfloat16, torch.float32):
                meta = block_sizes(rows, d, dtype)
                assert all(meta[b] & (meta[b] - 1) == 0 and meta[b] >= 16 for b in ("BLOCK_M", "BLOCK_N"))
    # fp32 (FMA dots, whole tiles in registers) takes smaller tiles than bf16 at the same shape
    assert block_sizes(64, 128, torch.float32)["BLOCK_M"] * block_sizes(64, 128, torch.float32)["BLOCK_N"] < \
        block_sizes(64, 128, torch.bfloat16)["BLOCK_M"] * block_sizes(64, 128, torch.bfloat16)["BLOCK_N"]


# ----------------------------------------------------------------------------- model level
@pytest.fixture(scope="module")
def tiny_net():
    """2-layer qwen2 (qkv bias) with 6 query heads on 2 kv heads (group 3), head dim 16."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch="qwen2", vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16,
                      intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
                      tie_word_embeddings=False)
    net = Transformer(cfg).eval()
    for layer in net.layers:
        layer.attention.wqkv.bias.data.normal_(0.0, 0.1)   # drawn on CPU, then moved: same weights everywhere
    net.to(DEVICE)
    net.setup_cache(64)                                     # the cache on the weights' device
    return net


def _decode_steps(net, backend):
    """Prefill 20 tokens, one T = 1 step, a tree verify, the same verify with its prefix as an
    all-visible part of the block, and a drafter-style frontier forward (prefix = committed +
    root, block over scratch slots)."""
    attention = ops_for(backend, DEVICE).tree_attention
    net.kv.zero_()
    g = torch.Generator().manual_seed(8)
    tokens = on_device(torch.randint(0, 97, (1, 40), generator=g))
    tree = random_tree(9, seed=8, vocab=97, device=DEVICE)
    one = torch.ones(1, dtype=torch.long, device=DEVICE)
    with torch.inference_mode():
        out = {"prefill": net(tokens[:, :20], torch.arange(20, device=DEVICE), 0, attention=attention),
               "decode": net(tokens[:, 20:21], torch.tensor([20], device=DEVICE), 20, attention=attention)}
        tree_mask = tree.attn_mask()[None]
        out["tree"] = net(tree.tokens[None], tree.positions(21), AttentionPlan.tree(21 * one, tree_mask, 30),
                          attention=attention)
        full = torch.cat([torch.ones(1, 9, 21, dtype=torch.bool, device=DEVICE), tree_mask], dim=2)
        out["tree-full-mask"] = net(tree.tokens[None], tree.positions(21),
                                    AttentionPlan.explicit(21 + torch.arange(9, device=DEVICE)[None], 0 * one, full, 30),
                                    attention=attention)
        # 3 frontier nodes at slots 30..32 whose parents sit at scratch slots 22, 24, 24; the root
        # (slot 21) joins the prefix, so block column j is slot 22 + j.
        scratch = torch.zeros(1, 3, 11, dtype=torch.bool, device=DEVICE)
        scratch[0, 0, [0, 8]] = True
        scratch[0, 1, [2, 9]] = True
        scratch[0, 2, [2, 10]] = True
        out["frontier"] = net(tokens[:, 30:33], torch.full((3,), 23, device=DEVICE),
                              AttentionPlan.explicit(30 + torch.arange(3, device=DEVICE)[None], 22 * one, scratch, 33),
                              attention=attention)
    return out


def test_model_triton_backend_matches_torch(tiny_net):
    want = _decode_steps(tiny_net, "torch")
    got = _decode_steps(tiny_net, "triton")
    # The prefix as a block of ones is the same attention: bit-for-bit on the torch path.
    assert torch.equal(want["tree"], want["tree-full-mask"])
    # Measured: max |triton - torch| <= 5e-7 on logits of magnitude ~2 (fp32 sums in another order).
    for step in want:
        _assert_close(got[step], want[step], torch.float32)


def test_model_rejects_bad_backend_and_plan(tiny_net):
    with pytest.raises(ValueError, match="unknown backend"):
        ops_for("cuda", DEVICE)
    one = torch.ones(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"the plan's block must be bool \[B=1, T=2, L\]"):
        tiny_net(torch.zeros(1, 2, dtype=torch.long, device=DEVICE), torch.arange(2, device=DEVICE),
                 AttentionPlan.explicit(torch.zeros(1, 2, dtype=torch.long, device=DEVICE), 5 * one,
                                        torch.ones(1, 3, 7, dtype=torch.bool, device=DEVICE), 12))
    S = tiny_net.cache_len
    with pytest.raises(ValueError, match=f"the cache holds {S} slots"):
        tiny_net(torch.zeros(1, 2, dtype=torch.long, device=DEVICE), torch.arange(2, device=DEVICE),
                 AttentionPlan.tree((S - 1) * one, torch.ones(1, 2, 2, dtype=torch.bool, device=DEVICE), S + 1))
