"""EAGLE-3 drafting in the engine: a head over the real SmolLM2 target (fp32, random weights, a
reduced draft vocabulary with a non-trivial d2t map) decodes token-identically to `ar` with every
method, and every step's draft reads the target features of everything committed so far (the
accepted path, retrieved tokens and the bonus token's predecessor included)."""
import dataclasses

import pytest
import torch

import graft_tk
from graft_tk.batch import decode_batch
from graft_tk.config import GraftConfig
from graft_tk.decode import encode_prompt
from graft_tk.eagle3_drafter import Eagle3Drafter
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.methods import METHODS
from graft_tk.models.eagle3 import Eagle3Config, Eagle3Head

from .conftest import real_prompts

SPECULATIVE = [m for m in METHODS if m != "ar"]
DRAFT_VOCAB = 2048
CONFIG = GraftConfig()   # the default N, tau, K, D: the same expansion, pruning and graft as a small drafter


def _head(target, seed=0, target_config=None, **kw) -> Eagle3Head:
    """Random weights (norms around 1); draft vocabulary = DRAFT_VOCAB random target ids."""
    g = torch.Generator().manual_seed(seed)
    tc = target_config or target.config
    cfg = Eagle3Config.for_target(tc, draft_vocab_size=DRAFT_VOCAB, intermediate_size=256, **kw)
    shared = target.net.tok_embeddings.weight if tc.vocab_size == target.config.vocab_size else None
    head = Eagle3Head(cfg, shared)
    for p in head.parameters():
        noise = torch.randn(p.shape, generator=g)
        p.data = 1 + 0.1 * noise if p.dim() == 1 else 0.05 * noise
    head.lm_head.weight.data *= 20   # a confident head, so that tau-pruned trees keep drafted nodes
    ids = torch.randperm(tc.vocab_size, generator=g)[:DRAFT_VOCAB].sort().values
    head.set_vocab_map(ids - torch.arange(DRAFT_VOCAB))
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def head(smollm2):
    return _head(smollm2)


@pytest.mark.parametrize("prompt", real_prompts(n_humaneval=1, n_spec_bench=1), ids=lambda p: getattr(p, "id", "x"))
def test_every_method_with_an_eagle3_head_equals_ar(smollm2, head, prompt):
    ids = encode_prompt(smollm2, prompt.text, chat=True)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=16)
    for method in SPECULATIVE:
        got = graft_tk.decode(smollm2, ids, drafter=head, method=method, max_new_tokens=16,
                               config=CONFIG)
        assert got.tokens == ref.tokens, method
        if METHODS[method].drafts:   # (a pruning method with prompt lookup may skip the drafter: DraftGate)
            gated = METHODS[method].prune and METHODS[method].uses("prompt_lookup")
            assert got.stats["drafter_forwards_per_step"] >= (0.1 if gated else 1), method
            assert got.stats["nodes_by_source"].get("draft", 0) > 0, method


class _Recording(Eagle3Drafter):
    """Records, per step, the committed tokens and the root's drafted children (tokens, log-probs)."""

    def __init__(self, head):
        super().__init__(head)
        self.steps = []

    def draft(self, request, ops):
        pool = super().draft(request, ops)
        K, n = request.top_k, request.length[0]
        self.steps.append((request.context[0, :n].tolist(), pool.tokens[0, :K].clone(), pool.scores[0, :K].clone()))
        return pool


def test_each_draft_reads_the_target_features_of_all_committed_tokens(smollm2, head):
    """The incremental head (features kept from the prefill and each verify's accepted rows) gives the
    root the same distribution as the head run from scratch over target features of the whole context."""
    ids = encode_prompt(smollm2, "Count from one to twenty: one, two, three,", chat=True)
    rec = _Recording(head)
    engine = Engine(smollm2, rec, CONFIG)
    r = graft_tk.decode(smollm2, ids, method="graft", max_new_tokens=20, engine=engine)
    assert len(rec.steps) >= 2 and r.stats["mat"] > 1    # retrieval / prompt lookup got tokens accepted
    net, layers = smollm2.net, head.target_layers
    for committed, tokens, scores in rec.steps:
        L = len(committed)
        with torch.inference_mode():
            net.setup_cache(L)
            _, feats = net(torch.tensor([committed[:-1]]), torch.arange(L - 1), 0, hidden_layers=layers)
            head.setup_cache(L)
            logits, _ = head(torch.tensor([committed[1:]]), torch.arange(L - 1), 0, logits_at=-1, features=feats)
        logp = torch.log_softmax(logits[0, -1], -1)
        assert (logp[tokens] - scores).abs().max() < 1e-3, L
        assert abs(float(logp.max()) - float(scores[0])) < 1e-3, L


def test_a_head_for_another_target_is_a_clear_error(smollm2):
    other = _head(smollm2, target_config=dataclasses.replace(smollm2.config, vocab_size=50000))
    with pytest.raises(InputError, match="EAGLE-3 head was not built for"):
        graft_tk.decode(smollm2, "Hi", drafter=other, method="graft", max_new_tokens=4)
    with pytest.raises(InputError, match="drafter must be a Model"):
        graft_tk.decode(smollm2, "Hi", drafter=object(), method="graft", max_new_tokens=4)


def test_drafts_of_a_head_that_echoes_the_target_get_accepted(smollm2):
    """A head that reproduces the target's own logits at the previous position (fc picks the last
    layer's features, attention and MLP add nothing, the target's norm and lm_head) drafts 'the token
    just seen' again, which a target continuing a one-token repetition accepts: drafted nodes are committed."""
    tc = smollm2.config
    L, D = tc.n_layers, tc.dim
    head = Eagle3Head(Eagle3Config.for_target(tc, target_layers=(1, L // 2, L - 1), intermediate_size=64),
                      smollm2.net.tok_embeddings.weight)
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc.weight[:, 2 * D:] = torch.eye(D)
        head.norm.weight.copy_(smollm2.net.norm.weight)
        head.lm_head.weight.copy_(smollm2.net.lm_head_weight)
    head.eval().requires_grad_(False)
    ids = smollm2.tokenizer.encode("-", add_special_tokens=False) * 30   # SmolLM2 continues with more "-"
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=16)
    for method in ("tree", "graft"):
        got = graft_tk.decode(smollm2, ids, drafter=head, method=method, max_new_tokens=16, config=CONFIG)
        assert got.tokens == ref.tokens, method
        assert got.stats["accepted_by_source"].get("draft", 0) > 0, (method, got.stats["accepted_by_source"])


def test_triton_backend_with_an_eagle3_head_gives_the_torch_backend_tokens():
    """The head's tree-masked draft forwards run on the Triton tree attention too (interpreter on CPU)."""
    from .test_backends import CONFIG as SMALL, PROMPT, _model
    target = _model(1, 2)
    g = torch.Generator().manual_seed(3)
    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=200, target_layers=(0, 1, 1)),
                      target.net.tok_embeddings.weight).to(target.device)
    for p in head.parameters():
        p.data = (1 + 0.1 * torch.randn(p.shape, generator=g) if p.dim() == 1
                  else 0.15 * torch.randn(p.shape, generator=g)).to(p.device)
    head.set_vocab_map((torch.randperm(300, generator=g)[:200].sort().values - torch.arange(200)).to(target.device))
    head.eval().requires_grad_(False)
    for method in ("tree", "graft"):
        kw = dict(drafter=head, method=method, max_new_tokens=12, config=SMALL)
        ref = graft_tk.decode(target, PROMPT, backend="torch", **kw)
        got = graft_tk.decode(target, PROMPT, backend="triton", **kw)
        assert got.tokens == ref.tokens == graft_tk.decode(target, PROMPT, max_new_tokens=12).tokens, method
        assert got.stats["kernel_launches_per_step"] > 0, got.stats


def test_requests_drafting_with_an_eagle3_head_share_a_batch(smollm2, head):
    """Three ragged rows, each with its own head cache row and pending target features: every row's
    tokens are its plain decode."""
    prompts = [encode_prompt(smollm2, t, chat=True) for t in ("Name three colours.", "def fib(n):",
                                                               "Count from one to twenty: one, two,")]
    want = [graft_tk.decode(smollm2, ids, max_new_tokens=12).tokens for ids in prompts]
    got = decode_batch(Engine(smollm2, head, CONFIG).batch(3), prompts, "graft", 12)
    assert [tokens for tokens, _ in got] == want
    assert sum(s["nodes_by_source"].get("draft", 0) for _, s in got) > 0
