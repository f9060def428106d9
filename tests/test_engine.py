"""The one decode step: every method is lossless, alone or in a batch.

Greedy: token-identical to `ar` in fp32 on real prompts with real SmolLM2 weights (self-drafter =
the target's first layers). Sampling: a seed fixes every draw by position, so every method's
sampled text IS plain sampling's with that seed; and plain sampling follows the target's own
distribution (chi-square against exact probabilities on a tiny random model).
"""

import copy
import dataclasses

import pytest
import torch

import graft_tk
from graft_tk.adjacency import new_adjacency, update_adjacency
from graft_tk.batch import decode_batch
from graft_tk.config import GraftConfig
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.methods import METHODS
from graft_tk.models import Model
from graft_tk.models.transformer import ModelConfig, Transformer
from graft_tk.bench.prompts import load_prompts
from graft_tk.sampling import Sampling, target_probs

from .chi2 import chi2, chi2_critical
from .conftest import real_prompts, spec_bench_prompt

SPECULATIVE = [m for m in METHODS if m != "ar"]


@pytest.fixture(scope="module")
def self_drafter():
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=10, progress=False)


@pytest.mark.parametrize("prompt", real_prompts(1, 0), ids=lambda p: getattr(p, "id", "x"))
def test_every_method_equals_ar_greedy(smollm2, self_drafter, prompt):
    ids = encode_prompt(smollm2, prompt.text, chat=True)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=40)
    for method in SPECULATIVE:
        got = graft_tk.decode(smollm2, ids, drafter=self_drafter, method=method, max_new_tokens=40)
        assert got.tokens == ref.tokens, method
        assert got.stats["tokens"] == len(ref.tokens)


@pytest.fixture(scope="module")
def ragged(smollm2):
    """Four real prompts of different lengths (a HumanEval task, a Spec-Bench question, a short chat
    request, a raw text to continue) and their plain greedy decodes."""
    texts = [load_prompts("humaneval")[0].text, spec_bench_prompt(), "Say hello in French.",
             "Count from one to twenty: one, two,"]
    prompts = [encode_prompt(smollm2, t, chat=i != 3) for i, t in enumerate(texts)]
    return prompts, [graft_tk.decode(smollm2, p, max_new_tokens=20).tokens for p in prompts]


@pytest.mark.parametrize("method", METHODS)
def test_a_batch_of_four_ragged_prompts_equals_each_alone(smollm2, self_drafter, ragged, method):
    """B = 4, prompts of different lengths in one step: every row's tokens are its plain decode."""
    prompts, ref = ragged
    got = decode_batch(Engine(smollm2, self_drafter).batch(4), prompts, method, 20)
    assert [tokens for tokens, _ in got] == ref, method
    for (tokens, stats), want in zip(got, ref):
        assert stats["tokens"] == len(want) and stats["steps"] >= 1


def test_methods_mix_in_one_batch(smollm2, self_drafter, ragged):
    """Rows of different methods share every step: each row's tree draws on its own sources."""
    prompts, ref = ragged
    batch = Engine(smollm2, self_drafter).batch(4)
    with torch.inference_mode():
        rows = [batch.add(p, m, 20) for p, m in zip(prompts, ["ar", "graft", "pld", "tree+pld"])]
        while len(batch):
            batch.step()
    assert [r.out for r in rows] == ref
    assert rows[0].stats.nodes == {} and rows[1].stats.nodes.get("draft", 0) > 0
    assert set(rows[2].stats.nodes) <= {"prompt_lookup"}


def test_seeded_sampling_is_plain_sampling_for_every_method_and_batch(smollm2, self_drafter, ragged):
    """A seed fixes the draw at every position: every method gives ar's sampled tokens, alone and
    in a batch of four (each row its own seed) — whatever M and the trees held."""
    prompts, _ = ragged
    kw = dict(max_new_tokens=16, temperature=0.8, top_p=0.9)
    alone = [graft_tk.decode(smollm2, p, seed=100 + i, **kw).tokens for i, p in enumerate(prompts)]
    other = [graft_tk.decode(smollm2, p, seed=7, **kw).tokens for p in prompts]
    assert other != alone                                                              # the seed matters
    for method in ("graft", "tree", "retrieval"):
        got = graft_tk.decode(smollm2, prompts[0], drafter=self_drafter, method=method, seed=100, **kw)
        assert got.tokens == alone[0], method
        batched = decode_batch(Engine(smollm2, self_drafter).batch(4), prompts, method, 16, Sampling(0.8, 0.9, 100))
        assert [tokens for tokens, _ in batched] == alone, method


def test_stats_report_sources_depths_and_time(smollm2, self_drafter):
    r = graft_tk.decode(smollm2, "Write a haiku about trees.", drafter=self_drafter, method="graft",
                        max_new_tokens=24)
    s = r.stats
    assert s["steps"] >= 1 and s["mat"] >= 1.0
    assert s["mat"] == pytest.approx((len(r.tokens) - 1) / s["steps"])
    assert set(s["nodes_by_source"]) <= {"draft", "retrieval", "prompt_lookup", "suffix"}
    assert s["nodes_by_source"].get("draft", 0) > 0
    assert sum(s["accepted_by_source"].values()) == sum(s["accepted_by_depth"].values())
    assert {src: sum(d.values()) for src, d in s["accepted_by_source_depth"].items()} == s["accepted_by_source"]
    # the estimates' expectation, per source and tree depth: it sums to the per-source figure
    by_depth = s["expected_accepted_by_source_depth"]
    assert set(by_depth) == set(s["expected_accepted_by_source"]) and by_depth["draft"]
    for src, depths in by_depth.items():
        assert sum(depths.values()) == pytest.approx(s["expected_accepted_by_source"][src], abs=0.01 * len(depths))
        assert all(d >= 1 and x >= 0 for d, x in depths.items())
    assert set(s["time_split"]) == {"draft", "retrieve", "verify", "commit"}
    assert s["drafter_forwards_per_step"] >= 1


def test_host_reads_per_step_are_counted_and_bounded(smollm2, self_drafter):
    # Each device -> host read stalls a GPU step: one per step for the outcome, and for a method
    # that prunes one per drafter depth whose stop flags decide the next forward (every forward
    # but the last when it runs the full depth D); with prompt lookup beside the drafter, one more
    # for the draft gate (and a drafter skipped by it catches up in its next forward, unread).
    ids = encode_prompt(smollm2, "Count from one to twenty: one, two, three,", chat=False)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=16)
    assert ref.stats["host_syncs_per_step"] == 1.0
    for method in SPECULATIVE:
        m = METHODS[method]
        engine = Engine(smollm2, self_drafter if m.drafts else None, GraftConfig(tau=0.3))
        r = graft_tk.decode(smollm2, ids, method=method, engine=engine, max_new_tokens=16)
        assert r.tokens == ref.tokens, method
        reads = r.stats["host_syncs_per_step"]
        if m.prune and m.uses("prompt_lookup"):
            assert reads - 2 <= r.stats["drafter_forwards_per_step"], method
        elif m.prune:
            forwards = r.stats["drafter_forwards_per_step"]
            assert forwards - 1 <= reads - 1 <= forwards, method
        else:
            assert reads == 1, method


def test_budget_one_degenerates_to_ar(smollm2, self_drafter):
    ref = graft_tk.decode(smollm2, "List three fruits.", max_new_tokens=12)
    got = graft_tk.decode(smollm2, "List three fruits.", drafter=self_drafter, method="graft",
                          config=GraftConfig(budget=1), max_new_tokens=12)
    assert got.tokens == ref.tokens and got.stats["mat"] == 1.0


def test_engine_keeps_the_adjacency_warm_across_calls(smollm2):
    engine = Engine(smollm2, config=GraftConfig(warm_from_prefill=False))
    assert engine.state.source("adjacency") is None                       # made on a request's first use
    first = graft_tk.decode(smollm2, "Count from 1 to 20.", method="retrieval", engine=engine, max_new_tokens=40)
    filled = int((engine.state.source("adjacency").matrix >= 0).any(-1).sum())
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
    M = engine.state.source("adjacency").matrix
    expected = update_adjacency(new_adjacency(*M.shape), torch.tensor(ids), logits)
    assert int((expected >= 0).any(-1).sum()) == len(set(ids))
    assert torch.equal(M, expected)


LONG = ("Inventory: " + "; ".join(f"bin {i} holds {i * 7 % 13} bolts and {i * 5 % 11} nuts" for i in range(40))
        + ". List bins 30 to 35 with what each holds, in the same words.")


def test_a_windowed_drafter_reads_only_the_sink_and_the_window_of_a_prompt(smollm2, self_drafter):
    """With drafter_window W and drafter_sink S the drafter's cache holds S + W prompt tokens and
    what was committed after, read in the first step that drafts (the prefill runs no drafter
    forward): its proposals change, the output does not."""
    ids = encode_prompt(smollm2, LONG, chat=True)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=24).tokens
    config = GraftConfig(drafter_window=24, drafter_sink=4)
    engine = Engine(smollm2, self_drafter, config)
    drafter, batch = engine.runtime.drafter, engine.batch(1)
    request = batch.add(ids, "tree", 24)
    assert drafter.kv_len[0] == 0 and drafter.skipped[0] == len(ids) - 28       # nothing read at prefill
    batch.step()
    assert 28 <= drafter.kv_len[0] <= 28 + len(request.out)                    # the sink, the window, the answer
    while not request.done:
        batch.step()
    assert request.out == ref
    assert drafter.kv_len[0] <= 28 + len(request.out)
    for method in ("tree", "graft"):
        got = graft_tk.decode(smollm2, ids, drafter=self_drafter, method=method, config=config, max_new_tokens=24)
        assert got.tokens == ref, method
    prompts = [ids, encode_prompt(smollm2, "Say hi.", chat=True), ids[:60], encode_prompt(smollm2, LONG[:400], chat=True)]
    want = [graft_tk.decode(smollm2, p, max_new_tokens=12).tokens for p in prompts]
    got = decode_batch(Engine(smollm2, self_drafter, config).batch(3), prompts, "graft", 12)
    assert [tokens for tokens, _ in got] == want


def test_a_drafter_more_than_a_window_behind_reads_its_window_again(smollm2, self_drafter, monkeypatch):
    """Steps that do not draft leave the drafter behind; once it is more than a window behind,
    its next drafting step reads the sink and the window before the root again (as a new prompt
    does) instead of every token it missed. The output does not change."""
    from graft_tk.policy import StepController
    ids = encode_prompt(smollm2, LONG, chat=True)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=30).tokens
    engine = Engine(smollm2, self_drafter, GraftConfig(drafter_window=8, drafter_sink=2))
    drafter, batch = engine.runtime.drafter, engine.batch(1)
    request = batch.add(ids, "tree", 30)
    batch.step()
    read = drafter.kv_len[0]
    assert read >= 10 and drafter.skipped[0] == len(ids) - 10

    class NoDrafting(StepController):
        def plan(self, plan, free):
            return dataclasses.replace(plan, drafts=(False,) * len(plan.drafts))
    with monkeypatch.context() as m:
        m.setattr(engine.state, "controller", lambda methods: NoDrafting())
        while request.length - drafter.skipped[0] - drafter.kv_len[0] <= 8:    # one token a step
            batch.step()
    assert drafter.kv_len[0] == read
    n = request.length
    batch.step()                      # drafts: reads the sink and the 8 tokens before its root
    assert drafter.skipped[0] == n - 1 - 10
    assert 11 <= drafter.kv_len[0] <= 11 + request.length - n
    while not request.done:
        batch.step()
    assert request.out == ref


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


def test_the_drafter_never_drafts_deeper_or_wider_than_the_budget_can_verify(smollm2, self_drafter):
    """A tree of N nodes (its root one of them) holds N - 1 drafted nodes, so a step drafts at most
    N - 1 depths and N - 1 children a node whatever D and K are: with N = 3, D = 6 and K = 4 it
    once ran 6 drafter forwards (4 rows wide) a step for 2 usable nodes (the int4 target's knee
    on a CPU without AMX is N = 3)."""
    ids = encode_prompt(smollm2, "Count from one to twenty: one, two, three,", chat=False)
    ref = graft_tk.decode(smollm2, ids, max_new_tokens=16)
    for method in ("tree", "graft-paper"):
        engine = Engine(smollm2, self_drafter, GraftConfig(budget=3, max_depth=6, top_k=4, tau=1e-6))
        requests, draft = [], engine.runtime.drafter.draft
        engine.runtime.drafter.draft = lambda request, ops: requests.append(request) or draft(request, ops)
        got = graft_tk.decode(smollm2, ids, method=method, engine=engine, max_new_tokens=16)
        assert got.tokens == ref.tokens and 1 <= got.stats["drafter_forwards_per_step"] <= 2, method
        assert requests and {(r.max_depth, r.top_k) for r in requests} == {(2, 2)}, method


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=0), "budget"), (dict(tau=0.0), "tau"), (dict(tau=1.5), "tau"), (dict(top_k=0), "top_k"),
    (dict(max_depth=-1), "max_depth"), (dict(retrieval_k=0), "retrieval_k"), (dict(template=()), "template"),
    (dict(pld_tokens=0), "pld_tokens"), (dict(pld_max_ngram=0), "pld_max_ngram"), (dict(copy_budget=0), "copy_budget"),
    (dict(suffix_max_match=0), "suffix_max_match"), (dict(suffix_chains=0), "suffix_chains"),
    (dict(suffix_tokens=0), "suffix_tokens"),
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


def test_a_batch_refuses_bad_requests_before_they_take_a_row(smollm2):
    """F7 (issue 38): empty prompts, ids outside the vocabulary, prompts past the context."""
    batch = Engine(smollm2).batch(2)
    ctx = smollm2.config.max_position_embeddings
    for ids, message in [([], "prompt is empty"), ([1, 10 ** 9], "token ids must be ints"),
                         ([1] * ctx, "exceeds the model's context"), ([1, 2], "max_new_tokens")]:
        with pytest.raises(InputError, match=message):
            batch.add(ids, "ar", -1 if message == "max_new_tokens" else 8)
    assert len(batch) == 0


# ---------------------------------------------------------------- sampling is lossless

class _TinyTokenizer:
    chat_template = None

    def __init__(self, eos_token_id=None):
        self.eos_token_id = eos_token_id

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def differences(self, other):
        return []           # every tiny model numbers its tokens alike: id i is "i"


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


# Small enough that every source's candidates collide and several steps fit in 5 tokens.
N_SAMPLES = 800
SAMPLING_CONFIG = GraftConfig(budget=6, top_k=2, max_depth=2, tau=0.2, retrieval_k=3, template=(2, 2),
                              pld_tokens=2, pld_max_ngram=2)


def sample_joint(method: str, target: Model, drafter: Model, n_samples: int, temperature: float, top_p: float,
                 prompt=(1, 3, 0, 1), n_tokens: int = 5, config: GraftConfig = SAMPLING_CONFIG,
                 max_batch: int = 4) -> torch.Tensor:
    """Counts of each n-token sequence over ``n_samples`` seeded requests, ``max_batch`` at a time
    through one engine (M and the estimates change between steps, as in serving)."""
    V = target.config.vocab_size
    engine = Engine(target, drafter if METHODS[method].drafts else None, config)
    results = decode_batch(engine.batch(max_batch), [list(prompt)] * n_samples, method, n_tokens,
                           Sampling(temperature, top_p, 0))
    counts = torch.zeros(V ** n_tokens)
    for tokens, _ in results:
        counts[sum(t * V ** (n_tokens - 1 - j) for j, t in enumerate(tokens))] += 1
    return counts


@pytest.fixture(scope="module")
def tiny_pair():
    """(target, drafter, exact P of 5 tokens at T = 0.7, top_p = 0.8)."""
    target, drafter = _tiny(1, 2, vocab=4), _tiny(2, 1, vocab=4)
    return target, drafter, exact_joint(target, [1, 3, 0, 1], 5, 0.7, 0.8)


def test_sampling_matches_the_exact_joint_distribution(tiny_pair):
    """Five sampled tokens follow the target's exact joint distribution at temperature 0.7 and
    top_p 0.8 (plain sampling; every method draws these same tokens, tested below and above)."""
    target, drafter, exact = tiny_pair
    counts = sample_joint("ar", target, drafter, N_SAMPLES, 0.7, 0.8)
    stat, df = chi2(counts, exact)
    assert stat < chi2_critical(df), (stat, df)


def test_adaptive_sampling_matches_the_exact_joint_distribution(tiny_pair):
    """Drafting, depth and verify width chosen per step by a steep cost model (graft, every source,
    one request at a time: what the policy steers) still sample the target's exact joint distribution."""
    from graft_tk.cost import StepCost
    target, drafter, exact = tiny_pair
    cost = StepCost(verify_ms=(10.0, 12.0, 15.0, 19.0, 24.0, 30.0), draft_ms=(0.5, 1.0), step_ms=1.0)
    counts = sample_joint("graft", target, drafter, N_SAMPLES, 0.7, 0.8,
                          config=dataclasses.replace(SAMPLING_CONFIG, cost=cost), max_batch=1)  # alone: steered
    stat, df = chi2(counts, exact)
    assert stat < chi2_critical(df), (stat, df)


@pytest.mark.parametrize("method", SPECULATIVE)
def test_every_method_samples_the_tokens_ar_samples(tiny_pair, method):
    """Two or more speculative steps per request (KV commit, drafter commit, M and the estimates
    in the test): every request's sampled tokens are ar's with the same seed."""
    target, drafter, _ = tiny_pair
    engine = Engine(target, drafter, SAMPLING_CONFIG)
    prompts = [[1, 3, 0, 1], [2, 2, 1, 0, 3], [0], [3, 1, 3, 1, 3, 1]] * 10
    want = decode_batch(Engine(target).batch(1), prompts, "ar", 6, Sampling(0.7, 0.8, 11))
    got = decode_batch(engine.batch(4), prompts, method, 6, Sampling(0.7, 0.8, 11))
    assert [t for t, _ in got] == [t for t, _ in want]
    assert sum(s["steps"] for _, s in got) < sum(s["steps"] for _, s in want)     # it speculated


def test_the_sampling_test_catches_a_choice_that_ignores_temperature_and_top_p(tiny_pair, monkeypatch):
    """The chi-square test above has the power to fail: with every draw at T = 1, top_p = 1 it does."""
    import graft_tk.sampling as sampling_mod
    target, drafter, exact = tiny_pair
    real = sampling_mod.truncated_probs
    monkeypatch.setattr(sampling_mod, "truncated_probs", lambda logits, t, p: real(logits, 1.0, 1.0))
    counts = sample_joint("ar", target, drafter, N_SAMPLES, 0.7, 0.8)
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


def test_an_unseeded_sampled_decode_leaves_the_global_rng_alone():
    """F9 (issue 38): an unseeded sampled decode reseeded torch's global RNG; its seed now comes from
    the OS, and is reported so the text can be reproduced."""
    target = _tiny(3, 2, vocab=6)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    r = graft_tk.decode(target, [1, 2, 3], max_new_tokens=6, temperature=1.0)
    assert torch.equal(torch.get_rng_state(), state)
    again = graft_tk.decode(target, [1, 2, 3], max_new_tokens=6, temperature=1.0, seed=r.stats["seed"])
    assert again.tokens == r.tokens


def test_a_tiny_temperature_is_greedy():
    """F5 (issue 38): temperature 1e-40 once gave NaN probabilities; below MIN_TEMPERATURE a request
    decodes greedily."""
    target = _tiny(3, 2, vocab=6)
    ref = graft_tk.decode(target, [1, 2, 3], max_new_tokens=10)
    got = graft_tk.decode(target, [1, 2, 3], max_new_tokens=10, temperature=1e-40, seed=1)
    assert got.tokens == ref.tokens
