"""The chain proposer (graft_tk.integrations.chain) driven the way vLLM drives it, by a minimal
engine that verifies one chain per request greedily, on the real SmolLM2 in fp32."""
import numpy as np
import pytest
import torch

import graft_tk
from graft_tk.errors import InputError
from graft_tk.integrations.chain import ChainConfig, ChainProposer

MAX_LEN = 256


class ChainEngine:
    """What vLLM does around a proposer, at temperature 0: each request's target cache row holds
    its committed tokens; a step verifies every request's proposed chain in one forward of its
    own, keeps the longest prefix the target agrees with plus the target's next token, and hands
    the proposer the tokens it committed (``sampled``) and the logits of the verified rows."""

    def __init__(self, target, proposer: ChainProposer | None, rows: int = 4):
        self.net, self.proposer = target.net, proposer
        self.net.setup_cache(MAX_LEN + 16, batch_size=rows)
        self.context: dict[str, list[int]] = {}
        self.row: dict[str, int] = {}
        self.token_ids = np.zeros((rows, MAX_LEN), dtype=np.int32)
        self.drafts: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int]) -> list[int]:
        """Prefill a request; returns its first token."""
        row = next(r for r in range(self.net.kv.shape[2]) if r not in self.row.values())
        self.row[req_id], self.context[req_id], self.drafts[req_id] = row, list(prompt), []
        logits = self._forward(req_id, 0, prompt)
        new = [int(logits[-1].argmax())]
        self.context[req_id] += new
        return new

    def verify(self, req_id: str) -> list[int]:
        """The last committed token and the drafts in one forward; returns the committed tokens."""
        ctx, drafts = self.context[req_id], self.drafts[req_id]
        feed = ctx[-1:] + drafts
        logits = self._forward(req_id, len(ctx) - 1, feed)
        if self.proposer is not None:
            self.proposer.observe_logits(torch.tensor(feed), logits)
        best = logits.argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == best[a]:
            a += 1
        new = drafts[:a] + [best[a]]
        ctx += new
        return new

    def _forward(self, req_id: str, start: int, tokens: list[int]):
        row = self.row[req_id]
        with torch.inference_mode(), self.net.cache_rows(row, row + 1):
            return self.net(torch.tensor([tokens]), torch.arange(start, start + len(tokens)), start)[0]

    def step(self, req_ids: list[str], sampled: list[list[int]]) -> list[list[int]]:
        """Propose for the batch (its rows in ``req_ids`` order), then verify; returns each
        request's newly committed tokens."""
        for b, rid in enumerate(req_ids):
            self.token_ids[b, :len(self.context[rid])] = self.context[rid]
        n = np.array([len(self.context[rid]) for rid in req_ids], dtype=np.int32)
        proposals = (self.proposer.propose(req_ids, sampled, n, self.token_ids) if self.proposer is not None
                     else [[] for _ in req_ids])
        assert len(proposals) == len(req_ids)
        out = []
        for rid, drafts in zip(req_ids, proposals):
            assert len(drafts) <= (self.proposer.config.k if self.proposer else 0)
            self.drafts[rid] = list(drafts)
            out.append(self.verify(rid))
        return out

    def finish(self, req_id: str) -> list[int]:
        del self.row[req_id]
        if self.proposer is not None:
            self.proposer.forget([req_id])
        return self.context.pop(req_id)


def generate(target, proposer, prompts: dict[str, list[int]], new_tokens: int, order=None) -> dict[str, list[int]]:
    """Greedy generation of every request (``order``: the batch's row order per step, a function of the step)."""
    engine = ChainEngine(target, proposer)
    sampled = {rid: engine.add(rid, p) for rid, p in prompts.items()}
    done = {}
    step = 0
    while sampled:
        ids = list(sampled) if order is None else order(step, list(sampled))
        for rid, new in zip(ids, engine.step(ids, [sampled[r] for r in ids])):
            sampled[rid] = new
            if len(engine.context[rid]) - len(prompts[rid]) >= new_tokens:
                done[rid] = engine.finish(rid)[len(prompts[rid]):][:new_tokens]
                del sampled[rid]
        step += 1
    return done


@pytest.fixture(scope="module")
def self_drafter():
    """SmolLM2 again, as its own drafter: it drafts exactly what the target will say."""
    return graft_tk.load_model("smollm2-135m", dtype="fp32", progress=False)


def _prompts(smollm2) -> dict[str, list[int]]:
    tok = smollm2.tokenizer
    return {"list": tok.encode("Count: one, two, three, four, five, six, seven, eight. Again: one, two, three,"),
            "code": tok.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):")}


def test_chain_proposals_leave_greedy_output_unchanged_and_the_self_drafter_is_always_right(smollm2, self_drafter):
    prompts = _prompts(smollm2)
    plain = generate(smollm2, None, prompts, 24)
    proposer = ChainProposer(ChainConfig(k=4, max_len=MAX_LEN, tau=0.01), smollm2.config.vocab_size, self_drafter)
    # rows swap every step: the drafter's cache rows must follow their requests
    spec = generate(smollm2, proposer, prompts, 24, order=lambda step, ids: ids[::-1] if step % 2 else ids)
    assert spec == plain
    s = proposer.stats
    assert s.drafter_forwards > 0 and s.proposed.get("draft", 0) > 0
    # the target's own weights draft what it says: every drafted token that was tried was accepted
    assert s.tried["draft"] > 0 and s.accepted["draft"] == s.tried["draft"]
    assert s.adjacency_rows > 0 and (proposer.matrix[:, 0] >= 0).sum() > 0
    assert proposer.live_requests == []


def test_prompt_lookup_and_the_successor_matrix_alone_are_lossless_and_accept_on_repetition(smollm2):
    prompts = _prompts(smollm2)
    plain = generate(smollm2, None, prompts, 32)
    proposer = ChainProposer(ChainConfig(k=5, max_len=MAX_LEN, draft=False), smollm2.config.vocab_size)
    assert generate(smollm2, proposer, prompts, 32) == plain
    s = proposer.stats
    assert s.drafter_forwards == 0
    assert s.accepted.get("prompt_lookup", 0) > 0        # the repeated count is looked up
    # M was learnt from the verified rows and proposes what the target ranked first after a token
    learnt = (proposer.matrix[:, 0] >= 0).nonzero().flatten()
    assert learnt.numel() > 0


def test_a_weak_drafter_is_cut_at_tau_and_retrieval_fills_the_chain(smollm2):
    """A 2-layer self-drafter is unsure: with a high tau it stops early, and the chain is filled from M."""
    drafter = graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=2, progress=False)
    prompts = _prompts(smollm2)
    plain = generate(smollm2, None, prompts, 24)
    proposer = ChainProposer(ChainConfig(k=6, max_len=MAX_LEN, tau=0.5, fill_min=0.01), smollm2.config.vocab_size,
                             drafter)
    assert generate(smollm2, proposer, prompts, 24) == plain
    proposed = proposer.stats.proposed
    assert proposed.get("retrieval", 0) > 0
    # never a drafted token below tau
    assert proposer.stats.proposed.get("draft", 0) <= proposer.stats.drafter_forwards * 2 * proposer.config.k


def test_forget_frees_rows_and_a_new_request_reuses_them(smollm2):
    proposer = ChainProposer(ChainConfig(k=3, max_len=MAX_LEN, draft=False), smollm2.config.vocab_size)
    tokens = np.zeros((2, MAX_LEN), dtype=np.int32)
    tokens[:, :5] = [[1, 2, 3, 1, 2], [4, 5, 6, 4, 5]]
    proposer.propose(["a", "b"], [[2], [5]], np.array([5, 5]), tokens)
    assert proposer.live_requests == ["a", "b"]
    proposer.forget(["a"])
    assert proposer.live_requests == ["b"]
    out = proposer.propose(["b", "c"], [[5], [2]], np.array([5, 5]), tokens[::-1].copy())
    assert proposer.live_requests == ["b", "c"] and len(proposer.rows) == 2
    assert out[0][:1] == [6] and out[1][:1] == [3]        # prompt lookup, each row its own context


@pytest.mark.parametrize("bad", [dict(k=0), dict(tau=0.0), dict(fill_min=1.5), dict(max_len=0)])
def test_chain_config_names_what_is_wrong(bad):
    with pytest.raises(InputError, match=next(iter(bad))):
        ChainConfig(**{"k": 4, "max_len": 64, **bad})
