"""Long prompts: every method equals plain decoding on a 2k-token prompt, alone and in a ragged batch
(fp32), with the drafter reading a window of it; a prompt past the model's context is a clear error."""
import pytest
import torch

import graft_tk
from graft_tk.batch import decode_batch
from graft_tk.bench.prompts import load_prompts
from graft_tk.compiled import EAGER_PREFILL_CHUNK, StepForward
from graft_tk.config import GraftConfig
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.methods import METHODS
from graft_tk.reference.tree_attention import tree_attention

CONFIG = GraftConfig(drafter_window=256)


@pytest.fixture(scope="module")
def self_drafter():
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=10, progress=False)


@pytest.fixture(scope="module")
def long_ids(smollm2):
    """The long set's 2k code edit and document question, as SmolLM2 tokenizes them."""
    prompts = load_prompts("long@2k")
    return [encode_prompt(smollm2, p.chat, chat=True) for p in (prompts[0], prompts[2])]


@pytest.mark.slow
def test_every_method_equals_ar_on_a_2k_token_prompt(smollm2, self_drafter, long_ids):
    ids = long_ids[0]
    assert len(ids) > 1500
    want = graft_tk.decode(smollm2, ids, max_new_tokens=16).tokens
    for method in [m for m in METHODS if m != "ar"]:
        got = graft_tk.decode(smollm2, ids, drafter=self_drafter, method=method, config=CONFIG, max_new_tokens=16)
        assert got.tokens == want, method


@pytest.mark.slow
def test_long_and_short_prompts_in_one_batch_equal_ar(smollm2, self_drafter, long_ids):
    prompts = [long_ids[0], encode_prompt(smollm2, "Name three colours.", chat=True), long_ids[1], long_ids[0][:300]]
    want = [graft_tk.decode(smollm2, p, max_new_tokens=12).tokens for p in prompts]
    for method in ("graft-paper", "graft", "retrieval+pld"):
        got = decode_batch(Engine(smollm2, self_drafter, CONFIG).batch(4), prompts, method, 12)
        assert [tokens for tokens, _ in got] == want, method


def test_a_prompt_past_the_context_names_the_limit(smollm2):
    context = smollm2.config.max_position_embeddings
    with pytest.raises(InputError, match=f"exceeds the model's context of {context} tokens"):
        graft_tk.decode(smollm2, [1] * (context - 4), method="pld", max_new_tokens=8)


def test_the_target_reads_a_long_prompt_in_chunks_and_reports_progress(smollm2, long_ids):
    ids = long_ids[1]
    n = len(ids)
    seen = []
    got = graft_tk.decode(smollm2, ids, method="pld", max_new_tokens=4, on_prefill=lambda read, total: seen.append((read, total)))
    chunk = EAGER_PREFILL_CHUNK
    assert seen == [(min(s + chunk, n), n) for s in range(0, n, chunk)] and len(seen) > 2
    # the chunks compute what one forward over the whole prompt computes
    net = smollm2.net
    net.setup_cache(n + 8)
    with torch.inference_mode():
        whole = net(torch.tensor([ids]), torch.arange(n), 0, logits_at=-1)
        chunked = StepForward(net).prefill(torch.tensor([ids]))
    torch.testing.assert_close(chunked, whole, atol=2e-4, rtol=1e-4)
    assert got.tokens[0] == int(whole[0, -1].argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_after_cached_keys_equals_the_masked_form(dtype):
    """A prefill chunk's attention (block None: causal after each row's prefix, torch's fused
    kernel) equals the same causal mask given as a block, over ragged prefixes and a loose key bound."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, T, D, S = 2, 4, 2, 37, 32, 200
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((Hq, T), (Hkv, S), (Hkv, S)))
    prefix, keys = torch.tensor([0, 90]), 150
    block = torch.ones(B, T, T, dtype=torch.bool).tril()
    got = tree_attention(q, k, v, prefix, None, keys)
    want = tree_attention(q, k, v, prefix, block, keys)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
