"""Prompt lookup: the longest suffix n-gram's latest earlier match decides the proposal.

The op reads a fixed-size context buffer on the device, a row per request (``context[b, :length[b]]``
committed), returns each row's chain padded with -1 and its matched n-gram length; the Triton kernel (interpreter) and the
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
    """The op over a buffer with ``spare`` junk slots past the committed tokens, as row 1 of a batch
    of three (rows 0 and 2 hold other contexts): (chain list, ngram, the padded chain)."""
    width = len(tokens) + spare
    other = [[3, 1, 3, 1, 3] + [2] * (width - 5), [9] * width] if width >= 5 else [[2] * width, [9] * width]
    buf = torch.tensor([other[0], tokens + [7] * spare, other[1]], dtype=torch.long, device=DEVICE)
    length = torch.tensor([min(5, width), len(tokens), width // 2], device=DEVICE)
    chain, ngram = op(buf, length, max_ngram, min_ngram, max_tokens)
    assert chain.shape == (3, max_tokens) and ngram.shape == (3,)
    alone = op(buf[1:2], length[1:2], max_ngram, min_ngram, max_tokens)    # a row alone gives its row
    assert torch.equal(alone[0][0], chain[1]) and torch.equal(alone[1][0], ngram[1])
    out = chain[1].tolist()
    return [t for t in out if t >= 0], int(ngram[1]), out


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
    four = torch.tensor([4], device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        OPS[backend](torch.zeros(1, 4, dtype=torch.int32, device=DEVICE), four)
    with pytest.raises(ValueError, match="length must be a tensor"):
        OPS[backend](torch.zeros(1, 4, dtype=torch.long, device=DEVICE), 4)
    with pytest.raises(ValueError, match="min_ngram"):
        OPS[backend](torch.zeros(1, 4, dtype=torch.long, device=DEVICE), four, max_ngram=1, min_ngram=2)
