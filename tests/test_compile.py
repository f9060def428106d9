"""Compiled step forwards (``compile=True``): whole graphs with no break, the same tokens as eager.

Real SmolLM2 weights in fp32, cut to a few layers: inductor's time per graph grows with the
depth (~8 s at 2 layers, ~20 s at 6 on two AVX2 cores), and every layer compiles alike.
"""
import pytest
import torch
from torch._dynamo.utils import counters

import graft_tk
from graft_tk.batch import decode_batch
from graft_tk.compiled import StepForward
from graft_tk.config import GraftConfig
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.methods import METHODS
from graft_tk.models.attention import AttentionPlan
from graft_tk.server.metrics import Metrics
from graft_tk.server.scheduler import Scheduler

from .conftest import real_prompts

@pytest.fixture(scope="module")
def target(smollm2_gguf):
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=3, progress=False)


@pytest.fixture(scope="module")
def drafter(smollm2_gguf):
    return graft_tk.load_model("smollm2-135m", dtype="fp32", num_layers=1, progress=False)


def test_compiled_forward_has_no_graph_break_and_matches_eager(target):
    net = target.net
    tokens = torch.tensor([[504, 3091, 282, 260, 6372]])
    with torch.inference_mode():
        net.setup_cache(64)
        net.kv.zero_()
        eager = net(tokens, torch.arange(5), 0)
        plan = AttentionPlan.tree(torch.tensor([5]), torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool),
                                  8)
        eager_tree = net(tokens[:, :3], torch.tensor([5, 6, 6]), plan)
        net.kv.zero_()
        breaks_before = sum(counters["graph_break"].values())
        step = StepForward(net, compile=True)                  # fullgraph: a break would raise
        compiled = step(tokens, torch.arange(5), 0)
        compiled_tree = step(tokens[:, :3], torch.tensor([5, 6, 6]), plan)
    assert sum(counters["graph_break"].values()) == breaks_before
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(compiled_tree, eager_tree, atol=1e-4, rtol=1e-4)


def test_every_method_compiled_equals_ar(target, drafter):
    # both prompts in one test: the second reuses the first's graphs (only its prefill is new);
    # a clone without Spec-Bench runs HumanEval's alone (real_prompts: its param is None there)
    for prompt in [p.values[0] for p in real_prompts(n_humaneval=1, n_spec_bench=1) if p.values[0] is not None]:
        ids = encode_prompt(target, prompt.text, chat=True)
        eager = graft_tk.decode(target, ids, max_new_tokens=24)
        ref = graft_tk.decode(target, ids, max_new_tokens=24, compile=True)
        assert ref.tokens == eager.tokens and ref.stats["compile"] == "on"   # compiled ar == eager ar here
        for method in ("tree", "graft"):      # every source, drafter and grafted (the step is one for all)
            got = graft_tk.decode(target, ids, drafter=drafter if METHODS[method].drafts else None, method=method,
                                  config=GraftConfig(), max_new_tokens=24, compile=True)
            assert got.tokens == ref.tokens, (prompt.id, method)
            gate = METHODS[method].prune and METHODS[method].uses("prompt_lookup")    # the draft gate's read
            assert got.stats["host_syncs_per_step"] <= 1 + gate + got.stats.get("drafter_forwards_per_step", 0), method


def test_a_compiled_batch_equals_each_request_alone(target, drafter):
    """The compiled step forwards serve a batch of ragged rows (one graph per batch shape)."""
    prompts = [encode_prompt(target, text, chat=True) for text in ("Name three colours.", "def add(a, b):")]
    want = [graft_tk.decode(target, ids, max_new_tokens=12).tokens for ids in prompts]
    got = decode_batch(Engine(target, drafter, GraftConfig(), compile=True).batch(2), prompts, "graft", 12)
    assert [tokens for tokens, _ in got] == want


def test_compile_drafter_compiles_only_the_drafter_and_equals_ar(target, drafter):
    engine = Engine(target, drafter, GraftConfig(), compile="drafter")
    assert engine.runtime.target_step.compiled is None and engine.runtime.drafter.step.compiled is not None
    ids = encode_prompt(target, "def add(a, b):", chat=True)
    want = graft_tk.decode(target, ids, max_new_tokens=16).tokens
    got = graft_tk.decode(target, ids, drafter=drafter, method="graft", engine=engine, max_new_tokens=16,
                          compile="drafter")
    assert got.tokens == want
    assert got.stats["compile"] == "drafter" and got.stats["drafter_forwards_per_step"] > 0


def test_a_compiled_drafter_forward_reads_only_its_contexts_keys(drafter):
    """A drafter's graphs have symbolic sizes, so they attend over the keys of the context (the
    plan's bound), not the whole static cache: one graph for every context length, and a server's
    4096-slot cache is not read whole by every drafter forward (one of the two reasons graft-serve
    --compile drafter served slower than eager). The slots past the context hold NaN: a read of
    them would show."""
    net = drafter.net
    step = StepForward(net, compile=True, dynamic=True)
    tokens = torch.tensor([[504, 3091, 282, 260, 6372, 30, 17]])
    graphs = []
    with torch.inference_mode():
        net.setup_cache(2048)
        for n in (5, 7):
            net.kv.zero_()
            eager = net(tokens[:, :n], torch.arange(n), 0)
            net.kv.zero_()
            net.kv[:, :, :, :, n:] = float("nan")
            got = step(tokens[:, :n], torch.arange(n), 0)
            torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]


def test_a_server_compiles_at_start_up_and_its_requests_compile_nothing(target, drafter):
    """graft-serve --compile drafter: the warm-up compiles the graphs of a batch of one, of two and
    of the full pool (three here: its cache strides differ from a part's), so requests alone and
    together then run without compiling, equal to plain greedy; the warm-up ran on a throwaway
    engine (the serving one has learnt nothing yet)."""
    scheduler = Scheduler(target, drafter, "graft", GraftConfig(), 8, Metrics(), max_batch=3, max_model_len=256,
                          compile="drafter")
    assert scheduler.warm_up() > 0
    assert scheduler.engine.state.draft_rates.n.sum() == 0 and scheduler.engine.runtime.drafter.step.compiled is not None
    prompts = [encode_prompt(target, text, chat=True) for text in ("Name three colours.", "def add(a, b):", "Hi")]
    want = [graft_tk.decode(target, ids, max_new_tokens=12).tokens for ids in prompts]
    graphs = counters["stats"]["unique_graphs"]
    for group in ([prompts[0]], prompts[:2], prompts):       # alone, two together, a full pool
        requests = []
        for ids in group:            # as the server admits them: one prompt read at a time
            while scheduler.batch.full:
                scheduler.batch.step()
            requests.append(scheduler.batch.add(ids, "graft", 12))
        while len(scheduler.batch):
            scheduler.batch.step()
        assert [r.out for r in requests] == want[:len(group)]
    assert counters["stats"]["unique_graphs"] == graphs
    assert Scheduler(target, None, "retrieval", GraftConfig(), 8, Metrics()).warm_up() == 0.0   # no compile: nothing


def test_the_graph_limit_holds_in_the_thread_that_decodes():
    """Dynamo's limit of graphs per code object is per thread: graft-serve's decode thread did not
    see a value set at start-up, and its 9th shape failed a request (fullgraph). ``graph_limited``
    sets it around every call; here on dynamo's eager backend (the limit is the backend's, not
    inductor's), 11 shapes in a new thread."""
    import threading

    from graft_tk.compiled import graph_limited

    def double(x):      # two functions: dynamo counts graphs per code object
        return x * 2 + 1

    def double_too(x):
        return x * 2 + 1

    failed = []

    def decode_thread(fn):
        try:
            for n in range(1, 12):
                assert torch.equal(fn(torch.ones(n)), torch.full((n,), 3.0))
        except Exception as e:  # noqa: BLE001
            failed.append(type(e).__name__)
    for f, limited, want in ((double, False, ["FailOnRecompileLimitHit"]), (double_too, True, [])):
        failed.clear()
        fn = torch.compile(f, backend="eager", fullgraph=True, dynamic=False)
        thread = threading.Thread(target=decode_thread, args=(graph_limited(fn) if limited else fn,))
        thread.start()
        thread.join()
        assert failed == want, limited


def test_an_engine_built_eager_refuses_compile(target):
    engine = Engine(target, None, GraftConfig())
    with pytest.raises(InputError, match="compile=True"):
        graft_tk.decode(target, "Hi", method="retrieval", engine=engine, compile=True, max_new_tokens=2)
    with pytest.raises(InputError, match="compile='drafter'"):
        graft_tk.decode(target, "Hi", method="retrieval", engine=engine, compile="drafter", max_new_tokens=2)
    with pytest.raises(InputError, match="compile must be True, False or one of 'off', 'drafter', 'on'"):
        Engine(target, None, GraftConfig(), compile="target")


def test_a_quantized_cpu_forward_compiles_frozen_with_its_gemms_autotuned(smollm2_gguf):
    """On a CPU the compiled graphs are frozen (weights constants, the KV cache and RoPE table graph
    inputs: a new cache reuses the graph) and a quantized model's GEMMs are autotuned (inductor's
    C++ templates where this CPU has them). torch.compile(options={"freezing": True}) once left both
    off without a sign. Inductor's caches are off here: a graph or autotune result cached by an
    earlier run (or test) replays without benchmarking, and the count would read 0."""
    from pathlib import Path

    import torch._inductor.config as inductor_config
    model = graft_tk.load_model("smollm2-135m", dtype="bf16", quant="int4", num_layers=1, progress=False)
    net, step = model.net, StepForward(model.net, compile=True)
    tokens = torch.tensor([[504, 3091, 282, 260]])
    counters.clear()
    with torch.inference_mode(), inductor_config.patch(force_disable_caches=True, autotune_local_cache=False):
        net.setup_cache(64)
        eager = net(tokens, torch.arange(4), 0)
        got = step(tokens, torch.arange(4), 0)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 1
        # inductor's C++ GEMM templates (what it autotunes) need AVX-512; elsewhere it picks ATen's
        templates = "avx512f" in Path("/proc/cpuinfo").read_text()
        assert (counters["inductor"]["select_algorithm_autotune"] >= 1) == templates
        net.kv = None
        net.setup_cache(64)                        # a new cache of the same shape: the same graph
        again = step(tokens, torch.arange(4), 0)
    assert counters["stats"]["unique_graphs"] == graphs
    diff = (got - eager).abs().max()
    assert diff <= 0.02 * eager.abs().max() and torch.equal(again, got)   # bf16 rounding
    # the rounding never changes a choice that is not a near tie: where eager's best two logits are
    # further apart than twice the largest difference, the compiled forward picks the same token
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert clear.any() and torch.equal(got.argmax(-1)[clear], eager.argmax(-1)[clear])


def test_a_compiled_quantized_prefill_runs_in_fixed_chunks_and_matches_the_eager_one(monkeypatch):
    """A quantized model compiled on a CPU with AMX prefills in PREFILL_CHUNK-token chunks through
    one graph (the last padded, or run eagerly where the padding would pass the cache's end): the
    same last logits, hidden states and cache entries as one eager forward, within bf16 rounding."""
    import graft_tk.compiled as compiled

    monkeypatch.setattr(compiled, "PREFILL_CHUNK", 10)
    model = graft_tk.load_model("smollm2-135m", dtype="bf16", quant="int4", num_layers=1, progress=False)
    monkeypatch.setattr(compiled, "amx_cpu", lambda: False)      # without AMX the chunks cost more: eager
    assert not StepForward(model.net, compile=True).chunked_prefill
    monkeypatch.setattr(compiled, "amx_cpu", lambda: True)
    net, step = model.net, StepForward(model.net, compile=True)
    assert step.chunked_prefill
    torch.manual_seed(0)
    counters.clear()
    graphs = []
    with torch.inference_mode():
        net.setup_cache(64)                                     # 512 slots
        # 19 tokens: 10 + 9 (padded); 511: 51 chunks, then 510 + 10 > 512 slots: the last token eagerly
        for n in (19, 511):
            prompt = torch.randint(0, model.config.vocab_size, (1, n))
            net.kv.zero_()
            eager, eager_hidden = net(prompt, torch.arange(n), 0, logits_at=-1, hidden_layers=(0,))
            eager_kv = net.kv[:, :, :, :, :n].clone()
            net.kv.zero_()
            got, hidden = step.prefill(prompt, hidden_layers=(0,))
            assert got.shape == eager.shape and hidden.shape == eager_hidden.shape
            assert (got - eager).abs().max() <= 0.02 * eager.abs().max() and got.argmax() == eager.argmax()
            assert (hidden.float() - eager_hidden.float()).abs().max() <= 0.02 * eager_hidden.float().abs().max()
            assert (net.kv[:, :, :, :, :n] - eager_kv).abs().max() <= 0.02 * eager_kv.abs().max()
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] >= 1     # one graph for every prompt length (a slice's strides once recompiled)
