"""Plain decoding (`ar`) on real SmolLM2 weights: HF transformers' greedy output is the oracle."""
import pytest
import torch

import graft_tk
from graft_tk.decode import encode_prompt
from graft_tk.errors import InputError

from .conftest import real_prompts


@pytest.mark.parametrize("prompt", real_prompts(), ids=lambda p: p.id)
def test_greedy_equals_hf_generate(smollm2, smollm2_hf, prompt):
    ids = encode_prompt(smollm2, prompt.text, chat=True)
    ours = graft_tk.decode(smollm2, ids, max_new_tokens=32)
    x = torch.tensor([ids])
    eos = list(smollm2.eos_token_ids)
    want = smollm2_hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                               eos_token_id=eos, pad_token_id=eos[0], top_p=None, top_k=None, temperature=None)
    assert ours.tokens == want[0, len(ids):].tolist()
    assert ours.stats["tokens"] == len(ours.tokens) > 0
    assert ours.text == smollm2.tokenizer.decode(ours.tokens)


def test_string_prompt_gets_chat_template(smollm2):
    ids = encode_prompt(smollm2, "Hello there", chat=True)
    text = smollm2.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>") and text.rstrip().endswith("<|im_start|>assistant")
    raw = encode_prompt(smollm2, "Hello there", chat=False)
    assert smollm2.tokenizer.decode(raw) == "Hello there"


def test_stops_at_eos(smollm2):
    # A prompt that asks for a one-word answer ends with <|im_end|> long before 200 tokens.
    r = graft_tk.decode(smollm2, "Reply with just the word: yes", max_new_tokens=200)
    assert r.tokens[-1] in smollm2.eos_token_ids
    assert len(r.tokens) < 200


def test_max_new_tokens_is_exact_and_zero_is_allowed(smollm2):
    assert len(graft_tk.decode(smollm2, "Count: 1, 2, 3,", max_new_tokens=7, chat=False).tokens) == 7
    assert graft_tk.decode(smollm2, "Count: 1, 2, 3,", max_new_tokens=0).tokens == []


def test_sampling_is_reproducible_with_a_seed(smollm2):
    a = graft_tk.decode(smollm2, "Tell me a story.", max_new_tokens=16, temperature=1.0, seed=7)
    b = graft_tk.decode(smollm2, "Tell me a story.", max_new_tokens=16, temperature=1.0, seed=7)
    c = graft_tk.decode(smollm2, "Tell me a story.", max_new_tokens=16, temperature=1.0, seed=8)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_streaming_callback_sees_every_token(smollm2):
    seen = []
    r = graft_tk.decode(smollm2, "Name three colours.", max_new_tokens=12, on_tokens=seen.extend)
    assert seen == r.tokens


@pytest.mark.parametrize("method", ["ar", "graft"])
def test_a_callback_that_returns_true_stops_decoding_after_that_batch(smollm2, method):
    full = graft_tk.decode(smollm2, "Name three colours.", method=method, drafter=smollm2, max_new_tokens=12)
    seen = []

    def stop_after_four(new):
        seen.extend(new)
        return len(seen) >= 4
    r = graft_tk.decode(smollm2, "Name three colours.", method=method, drafter=smollm2, max_new_tokens=12,
                        on_tokens=stop_after_four)
    assert r.tokens == seen and 4 <= len(r.tokens) < 12 and r.tokens == full.tokens[:len(r.tokens)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="   \n"), "prompt is empty"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[1, -5]), "token ids must be ints"),
    (dict(max_new_tokens=-1), "max_new_tokens must be"),
    (dict(temperature=-0.5), "temperature must be"),
    (dict(top_p=0.0), "top_p must be"),
    (dict(method="nope"), "unknown method 'nope'"),
])
def test_bad_input_is_a_clear_error(smollm2, kwargs, message):
    kwargs = {"prompt": "Hi", **kwargs}
    with pytest.raises(InputError, match=message):
        graft_tk.decode(smollm2, kwargs.pop("prompt"), **kwargs)


def test_prompt_longer_than_context_is_a_clear_error(smollm2):
    ctx = smollm2.config.max_position_embeddings
    with pytest.raises(InputError, match=f"exceeds the model's context of {ctx}"):
        graft_tk.decode(smollm2, [1] * (ctx + 1), max_new_tokens=1)
