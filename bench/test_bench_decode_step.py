"""One short decode per method on SmolLM2-135M with a self-drafter (its first 10 layers).

    python -m pytest bench/test_bench_decode_step.py --benchmark-only

Each round decodes ``TOKENS`` tokens of one HumanEval prompt from a fresh ``Engine`` (built in
the untimed setup, so every round starts cold like graft-bench's runs). The dtype is bf16, the
speed dtype; set GRAFT_TK_BENCH_DTYPE=fp32 to compare with exactness runs.
"""
import os

import pytest

import graft_tk
from graft_tk.methods import METHODS
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.bench.prompts import load_prompts

TOKENS = 8
DTYPE = os.environ.get("GRAFT_TK_BENCH_DTYPE", "bf16")


@pytest.fixture(scope="module")
def models(device):
    target = graft_tk.load_model("smollm2-135m", dtype=DTYPE, device=device, progress=False)
    drafter = graft_tk.load_model("smollm2-135m", dtype=DTYPE, device=device, num_layers=10, progress=False)
    ids = encode_prompt(target, load_prompts("humaneval")[0].text, chat=True)
    return target, drafter, ids


@pytest.mark.parametrize("method", METHODS)
def test_decode(benchmark, models, method):
    target, drafter, ids = models

    def setup():
        engine = Engine(target, drafter)
        return (), {"engine": engine}

    def run(engine):
        return graft_tk.decode(target, ids, method=method, engine=engine, max_new_tokens=TOKENS)

    benchmark.extra_info.update(model=target.name, drafter=drafter.name, dtype=DTYPE, method=method,
                                tokens=TOKENS, prompt_tokens=len(ids))
    result = benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1)
    benchmark.extra_info["mat"] = result.stats["mat"]
