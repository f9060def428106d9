"""Sources are plug-ins: one registered from this test module decodes losslessly beside the built-in
ones, alone and in a batch, and the step, the batch and the engine never name a source."""
import pytest
import torch

import graft_tk
from graft_tk.acceptance import PRIOR_WEIGHT, Rates, outcome
from graft_tk.batch import decode_batch
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.methods import Method
from graft_tk.sources import Candidates, CandidateSource, register, registered

CHAIN = 4


class FirstMatch(CandidateSource):
    """The tokens that followed the root's FIRST occurrence in the context (prompt lookup takes the
    latest match of the longest n-gram): a chain of ``CHAIN`` under the root, one rate per position."""
    name = "first_match"

    def __init__(self, config, ops, device, priors=None, vocab_size=0):
        super().__init__(config, ops, device)
        self.parents = torch.arange(-1, CHAIN - 1, dtype=torch.int32, device=device)
        self.rates = Rates(torch.full((CHAIN,), 0.5, device=device), torch.full((CHAIN,), PRIOR_WEIGHT, device=device))

    @property
    def rate_tables(self):
        return (self.rates,)

    def propose(self, view):
        context, length = view.context, view.length
        B, W = context.shape
        j = torch.arange(W, device=context.device)
        hit = (context == view.roots[:, None]) & (j < length[:, None] - 1)
        first = torch.where(hit, j, W).min(1).values                        # W: no earlier occurrence
        at = first[:, None] + 1 + torch.arange(CHAIN, device=context.device)
        ok = (first < W)[:, None] & (at < length[:, None])
        tokens = torch.where(ok, context.gather(1, at.clamp(max=W - 1)), -1)
        return Candidates(tokens, self.rates.rate().log().expand(B, CHAIN))

    def observe(self, built, on_path, nodes, note):
        tried, accepted = outcome(built, on_path, nodes, self.code)
        self.rates.count(torch.arange(CHAIN, device=nodes.device).expand_as(nodes), tried, accepted)


if FirstMatch.name not in registered():     # once per process (a test worker imports this module once)
    register(FirstMatch, before="adjacency")
GRAFT_FIRST = Method("graft+first_match", ("draft", "first_match", "adjacency"), prune=True)
ONLY_FIRST = Method("first_match", ("first_match",))
@pytest.fixture(scope="module")
def self_drafter():
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=10, progress=False)


@pytest.fixture(scope="module")
def prompts(smollm2):
    texts = [PROMPT, "def add(a, b):\n    return a + b\n\ndef sub(a, b):", "Name three colours.", "Count to ten."]
    return [encode_prompt(smollm2, text, chat=True) for text in texts]


PROMPT = ("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
          "Now repeat it again, then once more:")


def test_a_source_registered_outside_the_package_decodes_losslessly(smollm2, self_drafter):
    want = graft_tk.decode(smollm2, PROMPT, max_new_tokens=40)
    for method in (ONLY_FIRST, GRAFT_FIRST):
        got = graft_tk.decode(smollm2, PROMPT, drafter=self_drafter, method=method, max_new_tokens=40)
        assert got.tokens == want.tokens, method.name
        assert got.stats["nodes_by_source"]["first_match"] > 0, got.stats["nodes_by_source"]
    assert got.stats["accepted_by_source"].get("first_match", 0) > 0, got.stats["accepted_by_source"]
    assert list(registered()).index("first_match") < list(registered()).index("adjacency")


def test_a_registered_source_in_a_ragged_batch_beside_other_methods(smollm2, self_drafter, prompts):
    engine = Engine(smollm2, self_drafter)
    want = [graft_tk.decode(smollm2, p, max_new_tokens=16).tokens for p in prompts[:4]]
    got = decode_batch(engine.batch(4), prompts[:4], GRAFT_FIRST, 16)
    assert [tokens for tokens, _ in got] == want
    assert engine.state.source("first_match").rates.n.sum() > 0       # it counted outcomes


def test_registering_a_bad_source_names_the_problem():
    with pytest.raises(InputError, match="registered already"):
        register(FirstMatch)
    with pytest.raises(InputError, match="CandidateSource subclass"):
        register(object)
    with pytest.raises(InputError, match="no such source"):
        class Other(FirstMatch):
            name = "other_source"
        register(Other, before="nope")
