"""Our transformer reproduces HF transformers' logits on the same weights (the test oracle).

Random-weight configs cover each family's switch (qwen2: qkv bias; qwen3: q/k norm; llama3 rope
scaling); the real SmolLM2 weights cover the GGUF -> checkpoint path end to end.
"""
import pytest
import torch

import transformers

from graft_tk.models.checkpoint import load_transformer, read_config  # noqa: E402
from graft_tk.models.attention import AttentionPlan  # noqa: E402
from graft_tk.reference.commit_kv import commit_kv  # noqa: E402

from .tolerances import LOGITS_FP32_ATOL  # noqa: E402

TINY = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _hf_config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(**TINY, rope_theta=10000.0)
    if family == "llama3-scaled":
        return transformers.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if family == "qwen2":
        return transformers.Qwen2Config(**TINY, rope_theta=1e6, tie_word_embeddings=True)
    if family == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=32, rope_theta=1e6)  # head_dim != hidden/heads
    raise ValueError(family)


@pytest.fixture(scope="module", params=["llama", "llama3-scaled", "qwen2", "qwen3"])
def random_pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(request.param), torch_dtype=torch.float32)
    # Random init leaves biases at zero; give them values so the qkv-bias path is really exercised.
    for name, p in hf.named_parameters():
        if name.endswith("bias") or "norm" in name:
            p.data.normal_(1.0 if "norm" in name else 0.0, 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    ours = load_transformer(path, read_config(path), torch.float32, torch.device("cpu"))
    return hf.eval(), ours


def test_prefill_logits_match_hf(random_pair):
    hf, ours = random_pair
    tokens = torch.randint(0, 301, (1, 40), generator=torch.Generator().manual_seed(1))
    ours.setup_cache(64)
    got = ours(tokens, torch.arange(40), 0)
    want = hf(tokens).logits
    assert (got - want).abs().max().item() <= LOGITS_FP32_ATOL


def test_incremental_decode_matches_full_forward(random_pair):
    """Prefill 30 tokens, then feed 10 one at a time: same logits as one 40-token forward."""
    hf, ours = random_pair
    tokens = torch.randint(0, 301, (1, 40), generator=torch.Generator().manual_seed(2))
    want = hf(tokens).logits
    ours.setup_cache(64)
    steps = [ours(tokens[:, :30], torch.arange(30), 0)]
    for i in range(30, 40):
        steps.append(ours(tokens[:, i:i + 1], torch.tensor([i]), i))
    got = torch.cat(steps, dim=1)
    assert (got - want).abs().max().item() <= LOGITS_FP32_ATOL


def test_explicit_causal_block_equals_the_int_start(random_pair):
    """A prefill chunk after cached tokens (an int start: torch's fused attention with the causal
    mask shifted) computes what the same mask given as a tree block computes (the masked
    matmuls): equal to fp32 rounding, the same argmax everywhere."""
    _, ours = random_pair
    tokens = torch.randint(0, 301, (1, 12), generator=torch.Generator().manual_seed(3))
    ours.setup_cache(64)
    ours(tokens[:, :5], torch.arange(5), 0)
    implicit = ours(tokens[:, 5:], torch.arange(5, 12), 5)
    block = torch.ones(1, 7, 7, dtype=torch.bool).tril()
    explicit = ours(tokens[:, 5:], torch.arange(5, 12), AttentionPlan.tree(torch.tensor([5]), block, 12))
    torch.testing.assert_close(implicit, explicit, atol=1e-5, rtol=1e-5)
    assert torch.equal(implicit.argmax(-1), explicit.argmax(-1))


def test_commit_kv_moves_every_layer(random_pair):
    """Writing tokens at scattered slots then committing them equals writing them contiguously."""
    _, ours = random_pair
    tokens = torch.randint(0, 301, (1, 8), generator=torch.Generator().manual_seed(4))
    ours.setup_cache(64)
    ours(tokens, torch.arange(8), 0)
    contiguous = ours.kv[:, :, :, :, :8].clone()
    # Tokens 5..7 written at slots 10..12 (as a tree block would), then committed to 5..7.
    ours.kv[:, :, :, :, 5:8].zero_()
    ours(tokens[:, :5], torch.arange(5), 0)
    block = torch.ones(1, 3, 3, dtype=torch.bool).tril()
    ours(tokens[:, 5:], torch.arange(5, 8), AttentionPlan.explicit(torch.tensor([[10, 11, 12]]), torch.tensor([5]),
                                                                   torch.cat([torch.zeros(1, 3, 5, dtype=torch.bool),
                                                                              block], 2), 13))
    commit_kv(ours.kv, torch.tensor([[10, 11, 12]]), torch.tensor([5]))
    assert torch.allclose(ours.kv[:, :, :, :, :8], contiguous, atol=1e-6)


def test_a_packed_forward_computes_what_its_parts_compute_apart(random_pair):
    """A verify of 2 rows (a 4-node tree each) and a third row's prompt chunk in two parts, in ONE
    forward (their rows stacked for every linear layer): each part's logits, features and cache
    writes equal its own forward's (fp32 rounding); a part naming rows the cache lacks is refused."""
    from graft_tk.errors import InputError
    from graft_tk.models.transformer import Part
    _, ours = random_pair
    g = torch.Generator().manual_seed(5)
    ours.setup_cache(64, batch_size=3)
    for row, n in ((0, 20), (1, 13)):
        with ours.cache_rows(row, row + 1):
            ours(torch.randint(0, 301, (1, n), generator=g), torch.arange(n), 0)
    tree, chunk = torch.randint(0, 301, (2, 4), generator=g), torch.randint(0, 301, (1, 15), generator=g)
    prefix = torch.tensor([20, 13])
    block = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    plan = AttentionPlan.tree(prefix, block[None].expand(2, -1, -1).contiguous(), 24)
    positions = prefix[:, None] + torch.tensor([0, 1, 1, 2])
    before = ours.kv.clone()
    with ours.cache_rows(0, 2):
        want_tree = ours(tree, positions, plan)
    with ours.cache_rows(2, 3):
        want_chunk, want_hidden = ours(chunk, torch.arange(15), 0, logits_at=-1, hidden_layers=(0, 2))
    apart = ours.kv.clone()
    ours.kv.copy_(before)
    halves = [Part(chunk[:, a:b], torch.arange(a, b)[None], AttentionPlan.causal(a, 1, b - a, "cpu"), (2, 3), -1,
                   (0, 2)) for a, b in ((0, 8), (8, 15))]
    got_tree, (_, first_hidden), (got_chunk, second_hidden) = ours.forward_packed(
        [Part(tree, positions, plan, (0, 2)), *halves])
    torch.testing.assert_close(got_tree, want_tree, atol=LOGITS_FP32_ATOL, rtol=0)
    torch.testing.assert_close(got_chunk, want_chunk, atol=LOGITS_FP32_ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([first_hidden, second_hidden], 1), want_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.kv, apart, atol=1e-5, rtol=1e-5)
    with pytest.raises(InputError, match="cache rows"):
        ours.forward_packed([Part(tree, positions, plan, (2, 4))])
