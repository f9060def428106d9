"""Prompt lookup: the longest suffix n-gram's latest earlier match decides the proposal.

The op reads a fixed-size context buffer on the device (``context[:length]`` committed), returns
the chain padded with -1 and the matched n-gram length; the Triton kernel (interpreter) and the
torch reference are checked against a plain-Python statement of the rule.
"""
import random

import pytest
import torch

from graft_tk.kernels.prompt_lookup import prompt_lookup as prompt_lookup_triton
from graft_tk.reference.prompt_lookup import prompt_lookup as prompt_lookup_torch

from .kernel_utils import DEVICE

OPS = {"torch": prompt_lookup_torch, "triton": prompt_lookup_triton}


def spec(tokens: list[int], max_ngram: int, min_ngram: int, max_tokens: int) -> tuple[list[int], int]:
    """The rule, written plainly: longest n first, latest earlier window followed by a token."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        hits = [i for i in range(L - n) if tokens[i:i + n] == tokens[L - n:]]
        if hits:
            start = hits[-1] + n
            return tokens[start:start + max_tokens], n
    return [], 0


def run(op, tokens, max_ngram=3, min_ngram=1, max_tokens=10, spare=5):
    """The op over a buffer with ``spare`` junk slots past the committed tokens: (chain list, ngram)."""
    buf = torch.tensor(tokens + [7] * spare, dtype=torch.long, device=DEVICE)
    chain, ngram = op(buf, torch.tensor(len(tokens), device=DEVICE), max_ngram, min_ngram, max_tokens)
    assert chain.shape == (max_tokens,) and ngram.shape == ()
    out = chain.tolist()
    return [t for t in out if t >= 0], int(ngram), out


@pytest.mark.parametrize("backend", OPS)
def test_worked_examples(backend):
    op = OPS[backend]
    assert run(op, [5, 6, 7, 9, 5, 6])[:2] == ([7, 9, 5, 6], 2)                 # the module docstring's
    assert run(op, [1, 2, 3, 8, 0, 3, 4, 1, 2, 3], max_tokens=2)[:2] == ([8, 0], 3)   # longest n wins
    assert run(op, [7, 1, 7, 2, 7, 3, 7], max_ngram=1, max_tokens=1)[:2] == ([3], 1)  # latest match wins
    assert run(op, [1, 2, 3])[:2] == ([], 0)
    assert run(op, [4])[:2] == ([], 0)
    assert run(op, [4, 4])[:2] == ([4], 1)
    # the chain stops at the committed length (the junk 7s after it are never proposed), padded with -1
    assert run(op, [7, 1, 2, 3, 4, 5, 7], max_ngram=1, max_tokens=8)[2] == [1, 2, 3, 4, 5, 7, -1, -1]


@pytest.mark.parametrize("backend", OPS)
def test_random_contexts_follow_the_rule(backend):
    rng = random.Random(3)
    for trial in range(40):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]   # a small vocab repeats often
        max_ngram = rng.randrange(1, 5)
        min_ngram = rng.randrange(1, max_ngram + 1)
        got = run(OPS[backend], tokens, max_ngram, min_ngram, 6)[:2]
        assert got == spec(tokens, max_ngram, min_ngram, 6), (trial, tokens, max_ngram, min_ngram)


def test_long_context_crosses_kernel_blocks():
    rng = random.Random(4)
    tokens = [rng.randrange(50) for _ in range(2500)] + [11, 12, 13]
    tokens[100:104] = [11, 12, 13, 42]
    tokens[1800:1803] = [12, 13, 43]                  # a later, shorter match loses to the 3-gram
    want = spec(tokens, 3, 1, 4)
    assert want == ([42] + tokens[104:107], 3)
    for op in OPS.values():
        assert run(op, tokens, 3, 1, 4)[:2] == want


@pytest.mark.parametrize("backend", OPS)
def test_bad_arguments_are_named(backend):
    with pytest.raises(ValueError, match="int64"):
        OPS[backend](torch.zeros(4, dtype=torch.int32, device=DEVICE), 4)
    with pytest.raises(ValueError, match="min_ngram"):
        OPS[backend](torch.zeros(4, dtype=torch.long, device=DEVICE), 4, max_ngram=1, min_ngram=2)
