"""Shared fixtures: the real SmolLM2 model (through the registry, as users get it) and prompts."""
import os

import pytest
import torch

import graft_tk
from graft_tk.models import registry
from graft_tk.bench.prompts import load_prompts, spec_bench_path

# CI sets this: data that a user's clone may lack must be there, so a test never skips silently.
REQUIRE_DATA = os.environ.get("GRAFT_TK_REQUIRE_DATA") == "1"

# Under pytest-xdist (-n auto, pyproject.toml) the workers share the cores instead of each
# starting one torch thread per core.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct Q4_1 GGUF (98 MB, llama arch), fetched and sha256-verified by the registry."""
    return registry.fetch_gguf(registry.REGISTRY["smollm2-135m"], progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """Our model on real SmolLM2 weights, fp32 (exactness is judged in fp32)."""
    return graft_tk.load_model("smollm2-135m", dtype="fp32", progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """HF transformers on the same converted checkpoint: the oracle."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32).eval()


def real_prompts(n_humaneval: int = 2, n_spec_bench: int = 2) -> list:
    """HumanEval prompts plus the first Spec-Bench prompt of the first categories, as pytest params.

    Spec-Bench lives outside the repo (../shared/data); on a clone without it those params skip
    with a reason saying where to get it — except in CI, where its absence is an error.
    """
    params = [pytest.param(p, id=p.id) for p in load_prompts("humaneval")[:n_humaneval]]
    if spec_bench_path() is not None:
        spec = load_prompts("spec-bench", n_per_category=1)[:n_spec_bench]
        params += [pytest.param(p, id=f"spec-bench-{p.category}") for p in spec]
    elif REQUIRE_DATA:
        raise RuntimeError("Spec-Bench question.jsonl not found; CI needs ../shared/data/spec_bench/question.jsonl")
    else:
        reason = ("Spec-Bench prompts not found: set GRAFT_TK_SPEC_BENCH to Spec-Bench's "
                  "data/spec_bench/question.jsonl (github.com/hemingkx/Spec-Bench)")
        params += [pytest.param(None, id="spec-bench", marks=pytest.mark.skip(reason=reason))]
    return params


def spec_bench_prompt() -> str:
    """The first Spec-Bench question (MT-bench), or, on a clone without Spec-Bench (never in CI), a
    stand-in chat request."""
    if spec_bench_path() is not None:
        return load_prompts("spec-bench", n_per_category=1)[0].text
    if REQUIRE_DATA:
        raise RuntimeError("Spec-Bench question.jsonl not found; CI needs ../shared/data/spec_bench/question.jsonl")
    return "Name three colours."
