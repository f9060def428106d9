"""The speculative engine: every method is lossless.

Greedy: token-identical to `ar` in fp32 on real prompts with real SmolLM2 weights (self-drafter =
the target's first layers). Sampling: the committed tokens follow the target's own distribution
(chi-square against exact probabilities on a tiny random model), and a seed reproduces a run.
"""

import pytest
import torch

import graft_tk
from graft_tk.config import GraftConfig
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.models import Model
from graft_tk.models.transformer import ModelConfig, Transformer
from graft_tk.reference.accept import accept, greedy_accept
from graft_tk.reference.retrieval import new_adjacency
from graft_tk.sampling import target_probs
from graft_tk.tree import Tree

from .chi2 import chi2, chi2_critical
from .conftest import real_prompts

SPECULATIVE = ["tree", "pruned", "retrieval", "graft", "pld"]


@pytest.fixture(scope="module")
def self_drafter():
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=10, progress=False)


@pytest.mark.parametrize("prompt", real_prompts(), ids=lambda p: getattr(p, "id", "x"))
def test_every_method_equals_ar_greedy(smollm2, self_drafter, prompt):
    ids = encode_prompt(smollm2, prompt.text, chat=True)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=40)
    for method in SPECULATIVE:
        got = graft_tk.decode(smollm2, ids, drafter=self_drafter, method=method, max_new_tokens=40)
        assert got.tokens == ref.tokens, method
        assert got.stats["tokens"] == len(ref.tokens)


def test_stats_report_sources_depths_and_time(smollm2, self_drafter):
    r = graft_tk.decode(smollm2, "Write a haiku about trees.", drafter=self_drafter, method="graft",
                        max_new_tokens=24)
    s = r.stats
    assert s["steps"] >= 1 and s["mat"] >= 1.0
    assert s["mat"] == pytest.approx((len(r.tokens) - 1) / s["steps"])
    assert set(s["nodes_by_source"]) <= {"draft", "retrieval", "prompt_lookup"} and s["nodes_by_source"].get("draft", 0) > 0
    assert sum(s["accepted_by_source"].values()) == sum(s["accepted_by_depth"].values())
    assert set(s["time_split"]) == {"draft", "retrieve", "verify", "commit"}
    assert s["drafter_forwards_per_step"] >= 1


def test_budget_one_degenerates_to_ar(smollm2, self_drafter):
    ref = graft_tk.decode(smollm2, "List three fruits.", max_new_tokens=12)
    got = graft_tk.decode(smollm2, "List three fruits.", drafter=self_drafter, method="graft",
                          config=GraftConfig(budget=1), max_new_tokens=12)
    assert got.tokens == ref.tokens and got.stats["mat"] == 1.0


def test_engine_keeps_the_adjacency_warm_across_calls(smollm2):
    engine = Engine(smollm2, config=GraftConfig(warm_from_prefill=False))
    assert int((engine.adjacency >= 0).sum()) == 0
    first = graft_tk.decode(smollm2, "Count from 1 to 20.", method="retrieval", engine=engine, max_new_tokens=40)
    filled = int((engine.adjacency >= 0).any(-1).sum())
    assert filled > 0
    second = graft_tk.decode(smollm2, "Count from 1 to 20.", method="retrieval", engine=engine, max_new_tokens=40)
    assert second.tokens == first.tokens
    assert second.stats["mat"] > first.stats["mat"]  # the second request starts with M warm


def test_max_new_tokens_truncates_mid_path(smollm2, self_drafter):
    ref = graft_tk.decode(smollm2, "Count from 1 to 20.", max_new_tokens=30)
    for n in (1, 2, 5, 9):
        got = graft_tk.decode(smollm2, "Count from 1 to 20.", drafter=self_drafter, method="graft", max_new_tokens=n)
        assert got.tokens == ref.tokens[:n]


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=0), "budget"), (dict(tau=0.0), "tau"), (dict(tau=1.5), "tau"), (dict(top_k=0), "top_k"),
    (dict(max_depth=0), "max_depth"), (dict(retrieval_k=0), "retrieval_k"), (dict(template=()), "template"),
    (dict(pld_tokens=0), "pld_tokens"), (dict(pld_max_ngram=0), "pld_max_ngram"),
])
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(InputError, match=message):
        GraftConfig(**kwargs)


def test_prompt_lookup_proposes_what_followed_the_context(smollm2):
    """A prompt that asks to repeat its own text: pld's chain is accepted in long runs."""
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
    r = graft_tk.decode(smollm2, f"Repeat exactly: {text}", method="pld", max_new_tokens=30,
                        config=GraftConfig(budget=8, pld_tokens=7))
    assert r.tokens == graft_tk.decode(smollm2, f"Repeat exactly: {text}", max_new_tokens=30).tokens
    assert r.stats["accepted_by_source"].get("prompt_lookup", 0) > 0 and r.stats["mat"] > 1.5


def test_drafter_methods_need_a_drafter(smollm2):
    with pytest.raises(InputError, match="needs a drafter"):
        graft_tk.decode(smollm2, "Hi", method="graft")


# ---------------------------------------------------------------- sampling is lossless

def test_sampling_accept_follows_the_target_distribution():
    """Root with 3 candidate children (one with its own child): token 1 ~ p_root, token 2 ~ p_child."""
    g = torch.Generator().manual_seed(0)
    V = 6
    tree = Tree.from_lists([0, 2, 4, 1, 3], [-1, 0, 0, 0, 1])
    logits = torch.randn(5, V, generator=g) * 1.5
    counts1, counts2 = torch.zeros(V), torch.zeros(V)
    for _ in range(6000):
        path, n_path, bonus = accept(tree, logits, new_adjacency(V, 2), 1.0, 1.0, generator=g)
        seq = tree.tokens[path[1:int(n_path)]].tolist() + [int(bonus)]
        counts1[seq[0]] += 1
        if seq[0] == 2:                   # node 1 was accepted: the next token comes from node 1's p
            counts2[seq[1]] += 1
    for counts, node in ((counts1, 0), (counts2, 1)):
        stat, df = chi2(counts, target_probs(logits[node], 1.0, 1.0))
        assert stat < chi2_critical(df), (node, stat, df)


def test_greedy_accept_follows_argmax():
    tree = Tree.from_lists([0, 2, 4, 1, 3], [-1, 0, 0, 0, 1])
    logits = torch.full((5, 6), -1.0)
    logits[0, 2] = logits[1, 3] = logits[4, 5] = 1.0   # root -> 2 -> 3, then argmax 5 at node 4
    path, bonus = greedy_accept(tree, logits)
    assert path.tolist() == [0, 1, 4] and int(bonus) == 5


class _TinyTokenizer:
    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _tiny(seed: int, n_layers: int) -> Model:
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="llama", vocab_size=5, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                      head_dim=8, intermediate_size=48, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=64, tie_word_embeddings=False)
    net = Transformer(cfg)
    for p in net.parameters():
        p.data.normal_(0, 0.5)
    return Model(f"tiny{seed}", None, cfg, _TinyTokenizer(), net.eval().requires_grad_(False))


def test_graft_sampling_matches_exact_target_distribution():
    """On a 5-token vocab, P(t1, t2) is computed exactly; graft's samples must follow it."""
    target, drafter = _tiny(1, 2), _tiny(2, 1)
    prompt = [1, 3, 0]
    exact = torch.zeros(5, 5)
    with torch.inference_mode():
        target.net.setup_cache(8)
        for t1 in range(5):
            logits = target.net(torch.tensor([prompt + [t1]]), torch.arange(4), 0)[0]
            exact[t1] = target_probs(logits[-2], 1.0, 1.0)[t1] * target_probs(logits[-1], 1.0, 1.0)
    engine = Engine(target, drafter, GraftConfig(budget=6, top_k=2, max_depth=2, tau=0.2,
                                                    retrieval_k=3, template=(2, 2)))
    counts = torch.zeros(25)
    for i in range(2500):
        r = graft_tk.decode(target, prompt, method="graft", engine=engine, max_new_tokens=2,
                            temperature=1.0, seed=i)
        counts[r.tokens[0] * 5 + r.tokens[1]] += 1
    stat, df = chi2(counts, exact.flatten())
    assert stat < chi2_critical(df), (stat, df)


def test_sampling_with_a_seed_is_reproducible(smollm2, self_drafter):
    kw = dict(drafter=self_drafter, method="graft", max_new_tokens=20, temperature=0.8, top_p=0.95)
    a = graft_tk.decode(smollm2, "Tell me a story.", seed=3, **kw)
    b = graft_tk.decode(smollm2, "Tell me a story.", seed=3, **kw)
    assert a.tokens == b.tokens
