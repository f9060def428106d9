"""The speculative engine: every method is lossless.

Greedy: token-identical to `ar` in fp32 on real prompts with real SmolLM2 weights (self-drafter =
the target's first layers). Sampling: the committed tokens follow the target's own distribution
(chi-square against exact probabilities on a tiny random model), and a seed reproduces a run.
"""

import copy
import dataclasses

import pytest
import torch

import graft_tk
from graft_tk.config import METHODS, PRUNES, USES_DRAFTER, GraftConfig
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.models import Model
from graft_tk.models.transformer import ModelConfig, Transformer
from graft_tk.reference.accept import accept, greedy_accept
from graft_tk.adjacency import new_adjacency, update_adjacency
from graft_tk.sampling import target_probs
from graft_tk.tree import Tree

from .chi2 import chi2, chi2_critical
from .conftest import real_prompts

SPECULATIVE = [m for m in METHODS if m != "ar"]


@pytest.fixture(scope="module")
def self_drafter():
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=10, progress=False)


@pytest.mark.parametrize("prompt", real_prompts(1, 1), ids=lambda p: getattr(p, "id", "x"))
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


@pytest.mark.parametrize("static_shapes", [False, True])
def test_host_reads_per_step_are_counted_and_bounded(smollm2, self_drafter, static_shapes):
    # Each device -> host read stalls a GPU step. ar reads the token; a speculative step reads
    # everything the host needs after acceptance at once, plus the tree's size unless it verifies
    # at the fixed budget; a pruning drafter also reads its stop flag at each depth it may stop
    # after (every forward but the last when it runs the full depth D).
    ids = encode_prompt(smollm2, "Count from one to twenty: one, two, three,", chat=False)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=16)
    assert ref.stats["host_syncs_per_step"] == 1.0
    base = 1 if static_shapes else 2
    for method in SPECULATIVE:
        engine = Engine(smollm2, self_drafter if method in USES_DRAFTER else None, GraftConfig(tau=0.3),
                        static_shapes=static_shapes)
        r = graft_tk.decode(smollm2, ids, method=method, engine=engine, max_new_tokens=16)
        assert r.tokens == ref.tokens, method
        reads = r.stats["host_syncs_per_step"]
        if method in PRUNES:
            forwards = r.stats["drafter_forwards_per_step"]
            assert base + forwards - 1 <= reads <= base + forwards, method
        else:
            assert reads == base, method


@pytest.mark.parametrize("prompt", real_prompts()[:1], ids=lambda p: getattr(p, "id", "x"))
def test_every_method_equals_ar_greedy_with_static_shapes(smollm2, self_drafter, prompt):
    """Every tree verified at the full budget N (padding rows masked) still decodes exactly as ar."""
    ids = encode_prompt(smollm2, prompt.text, chat=True)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=40)
    for method in SPECULATIVE:
        engine = Engine(smollm2, self_drafter if method in USES_DRAFTER else None, GraftConfig(),
                        static_shapes=True)
        got = graft_tk.decode(smollm2, ids, method=method, engine=engine, max_new_tokens=40)
        assert got.tokens == ref.tokens, method


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
    later = [graft_tk.decode(smollm2, "Count from 1 to 20.", method="retrieval", engine=engine, max_new_tokens=40)
             for _ in range(2)]
    assert all(r.tokens == first.tokens for r in later)
    # later requests start with M (and the acceptance estimates) warm
    assert all(r.stats["mat"] >= first.stats["mat"] for r in later) and later[-1].stats["mat"] > first.stats["mat"]


def test_prefill_warms_the_adjacency_from_every_prompt_position(smollm2):
    # The warm-up ranks the prompt's logits a chunk at a time from the last layer's states; M
    # must be what the whole [n, V] logits of the prefill give.
    engine = Engine(smollm2)
    ids = encode_prompt(smollm2, "Count from 1 to 20, then back down to 1.", chat=True)
    graft_tk.decode(smollm2, ids, method="retrieval", engine=engine, max_new_tokens=1)
    net, n = smollm2.net, len(ids)
    net.setup_cache(n)
    with torch.inference_mode():
        logits = net(torch.tensor([ids]), torch.arange(n), 0)[0]
    expected = update_adjacency(new_adjacency(*engine.adjacency.shape), torch.tensor(ids), logits)
    assert int((expected >= 0).any(-1).sum()) == len(set(ids))
    assert torch.equal(engine.adjacency, expected)


def test_max_new_tokens_truncates_mid_path(smollm2, self_drafter):
    ref = graft_tk.decode(smollm2, "Count from 1 to 20.", max_new_tokens=30)
    for n in (1, 2, 5, 9):
        got = graft_tk.decode(smollm2, "Count from 1 to 20.", drafter=self_drafter, method="graft", max_new_tokens=n)
        assert got.tokens == ref.tokens[:n]


def test_depth_zero_decodes_without_the_drafter(smollm2, self_drafter):
    """D = 0: a drafter method proposes retrieval candidates only; no drafter forward, same tokens."""
    ref = graft_tk.decode(smollm2, "Count from 1 to 20.", max_new_tokens=24)
    got = graft_tk.decode(smollm2, "Count from 1 to 20.", drafter=self_drafter, method="graft", max_new_tokens=24,
                          config=GraftConfig(budget=8, max_depth=0))
    assert got.tokens == ref.tokens and got.stats["drafter_forwards_per_step"] == 0 and got.stats["mat"] > 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=0), "budget"), (dict(tau=0.0), "tau"), (dict(tau=1.5), "tau"), (dict(top_k=0), "top_k"),
    (dict(max_depth=-1), "max_depth"), (dict(retrieval_k=0), "retrieval_k"), (dict(template=()), "template"),
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
    chat_template = None

    def __init__(self, eos_token_id=None):
        self.eos_token_id = eos_token_id

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _tiny(seed: int, n_layers: int, vocab: int = 5, eos: int | None = None) -> Model:
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="llama", vocab_size=vocab, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                      head_dim=8, intermediate_size=48, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=64, tie_word_embeddings=False)
    net = Transformer(cfg)
    for p in net.parameters():
        p.data.normal_(0, 0.5)
    return Model(f"tiny{seed}", None, cfg, _TinyTokenizer(eos), net.eval().requires_grad_(False))


def exact_joint(target: Model, prompt: list[int], n_tokens: int, temperature: float, top_p: float) -> torch.Tensor:
    """P(t1 .. tn) for every sequence of n tokens, [V ** n] (t1 most significant), one forward per prefix."""
    V = target.config.vocab_size
    probs = torch.ones(1)
    with torch.inference_mode():
        for step in range(n_tokens):
            prefixes = torch.cartesian_prod(*[torch.arange(V)] * step).reshape(-1, step) if step else [[]]
            nxt = []
            for prefix in prefixes:
                ids = prompt + [int(t) for t in prefix]
                target.net.setup_cache(len(ids))
                logits = target.net(torch.tensor([ids]), torch.arange(len(ids)), 0)[0, -1]
                nxt.append(target_probs(logits, temperature, top_p))
            probs = (probs[:, None] * torch.stack(nxt)).flatten()
    return probs


# Small enough that every source's candidates collide and several steps fit in 5 tokens: at most
# 3 tokens per step (tree depth <= 2), so 5 new tokens take >= 2 speculative steps after the prefill.
N_SAMPLES = 800
SAMPLING_CONFIG = GraftConfig(budget=6, top_k=2, max_depth=2, tau=0.2, retrieval_k=3, template=(2, 2),
                              pld_tokens=2, pld_max_ngram=2)


def sample_joint(method: str, target: Model, drafter: Model, n_samples: int, temperature: float, top_p: float,
                 prompt=(1, 3, 0, 1), n_tokens: int = 5, static_shapes: bool = False,
                 config: GraftConfig = SAMPLING_CONFIG) -> tuple[torch.Tensor, float]:
    """(counts of each n-token sequence, mean speculative steps) over ``n_samples`` seeded decodes
    sharing one engine, so M and the acceptance estimates change between samples as in serving."""
    V = target.config.vocab_size
    engine = Engine(target, drafter if method in USES_DRAFTER else None, config, static_shapes=static_shapes)
    counts, steps = torch.zeros(V ** n_tokens), 0
    for i in range(n_samples):
        r = graft_tk.decode(target, list(prompt), method=method, engine=engine, max_new_tokens=n_tokens,
                            temperature=temperature, top_p=top_p, seed=i)
        counts[sum(t * V ** (n_tokens - 1 - j) for j, t in enumerate(r.tokens))] += 1
        steps += r.stats["steps"]
    return counts, steps / n_samples


@pytest.fixture(scope="module")
def tiny_pair():
    """(target, drafter, exact P of 5 tokens at T = 0.7, top_p = 0.8)."""
    target, drafter = _tiny(1, 2, vocab=4), _tiny(2, 1, vocab=4)
    return target, drafter, exact_joint(target, [1, 3, 0, 1], 5, 0.7, 0.8)


@pytest.mark.parametrize("method", SPECULATIVE)
def test_sampling_matches_the_exact_joint_distribution(tiny_pair, method):
    """Five sampled tokens (two or more speculative steps: KV commit, drafter commit, M and the
    acceptance estimates inside the test) follow the target's exact joint distribution at
    temperature 0.7 and top_p 0.8, for every speculative method."""
    target, drafter, exact = tiny_pair
    counts, steps = sample_joint(method, target, drafter, N_SAMPLES, 0.7, 0.8)
    assert steps >= 2
    stat, df = chi2(counts, exact)
    assert stat < chi2_critical(df), (method, stat, df)


def test_sampling_with_static_shapes_matches_the_exact_joint_distribution(tiny_pair):
    """Verifying at the fixed budget (padding rows in the tree) samples the same distribution."""
    target, drafter, exact = tiny_pair
    counts, steps = sample_joint("graft+pld", target, drafter, N_SAMPLES, 0.7, 0.8, static_shapes=True)
    assert steps >= 2
    stat, df = chi2(counts, exact)
    assert stat < chi2_critical(df), stat


def test_adaptive_sampling_matches_the_exact_joint_distribution(tiny_pair):
    """Drafting, depth and budget chosen per step (a steep cost model) still sample exactly."""
    from graft_tk.cost import StepCost
    target, drafter, exact = tiny_pair
    cost = StepCost(verify_ms=(10.0, 12.0, 15.0, 19.0, 24.0, 30.0), draft_ms=(0.5, 1.0), step_ms=1.0)
    counts, steps = sample_joint("graft+pld", target, drafter, N_SAMPLES, 0.7, 0.8,
                                 config=dataclasses.replace(SAMPLING_CONFIG, cost=cost))
    assert steps >= 2
    stat, df = chi2(counts, exact)
    assert stat < chi2_critical(df), stat


def test_the_sampling_test_catches_an_accept_that_ignores_temperature_and_top_p(tiny_pair, monkeypatch):
    """The test above has the power to fail: with accept deciding at T = 1 and top_p = 1 it does."""
    import graft_tk.engine as engine_mod
    target, drafter, exact = tiny_pair
    real_ops_for = engine_mod.ops_for

    def wrong_ops(backend, device):
        ops = real_ops_for(backend, device)
        wrong = lambda tree, logits, adj, temperature, top_p, uniforms: ops.accept(  # noqa: E731
            tree, logits, adj, 1.0, 1.0, uniforms)
        return dataclasses.replace(ops, accept=wrong)

    monkeypatch.setattr(engine_mod, "ops_for", wrong_ops)
    counts, _ = sample_joint("graft+pld", target, drafter, N_SAMPLES, 0.7, 0.8)
    stat, df = chi2(counts, exact)
    assert stat > chi2_critical(df), (stat, df)


def test_agreeing_drafter_deep_paths_and_eos_inside_paths():
    """A drafter that is a copy of the target makes whole drafted paths accepted, with EOS (token 2)
    inside some of them: every method still equals ar, on several random models and prompts."""
    config = GraftConfig(budget=8, top_k=2, max_depth=4, tau=0.05, retrieval_k=2, template=(2, 2, 2), pld_tokens=4)
    deep = eos_inside = 0
    for seed in range(3):
        target = _tiny(10 + seed, 2, vocab=6, eos=2)
        drafter = copy.deepcopy(target)
        g = torch.Generator().manual_seed(seed)
        for _ in range(4):
            prompt = torch.randint(6, (5,), generator=g).tolist()
            ref = graft_tk.decode(target, prompt, max_new_tokens=24)
            for method in SPECULATIVE:
                got = graft_tk.decode(target, prompt, drafter=drafter, method=method, max_new_tokens=24, config=config)
                assert got.tokens == ref.tokens, (seed, method, prompt)
                deep += max(got.stats["accepted_by_depth"], default=0) >= 3
            eos_inside += 2 in ref.tokens and len(ref.tokens) < 24
    assert deep > 0 and eos_inside > 0, (deep, eos_inside)


def test_sampling_with_a_seed_is_reproducible(smollm2, self_drafter):
    kw = dict(drafter=self_drafter, method="graft", max_new_tokens=20, temperature=0.8, top_p=0.95)
    a = graft_tk.decode(smollm2, "Tell me a story.", seed=3, **kw)
    b = graft_tk.decode(smollm2, "Tell me a story.", seed=3, **kw)
    assert a.tokens == b.tokens
