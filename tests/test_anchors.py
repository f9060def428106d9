"""The llama.cpp anchors' glue, with a stand-in for llama-cpp-python (CI does not build llama.cpp;
the real anchor is measured by graft-bench, README "Quantized weights")."""
import json
import sys
import types

import pytest
import torch

from graft_tk.bench import anchors
from graft_tk.cli.bench import main
from graft_tk.errors import InputError


class FakeLlama:
    """Records how it was built and driven; generates a scripted token stream."""
    made = []
    script = [11, 12, 13, 14, 15, 16, 17, 18]

    def __init__(self, model_path, n_ctx, n_threads, draft_model, logits_all, verbose):
        self.model_path, self.n_threads, self.draft_model, self.logits_all = model_path, n_threads, draft_model, logits_all
        self.calls = []
        FakeLlama.made.append(self)

    def reset(self):
        self.calls.append("reset")

    def set_seed(self, seed):
        self.calls.append(("seed", seed))

    def generate(self, tokens, **knobs):
        self.calls.append(("generate", list(tokens), knobs))
        yield from self.script          # the caller stops it


class FakePromptLookup:
    def __init__(self, num_pred_tokens):
        self.num_pred_tokens = num_pred_tokens


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    FakeLlama.made = []
    mod, spec = types.ModuleType("llama_cpp"), types.ModuleType("llama_cpp.llama_speculative")
    mod.Llama, spec.LlamaPromptLookupDecoding, mod.llama_speculative = FakeLlama, FakePromptLookup, spec
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    return FakeLlama


def test_llama_cpp_anchors_run_the_gguf_and_stop_like_our_decode(smollm2, fake_llama_cpp, tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    a = anchors.make_anchors(smollm2, None, ("llama_cpp", "llama_cpp_pld"), gguf)
    assert a.names == ("llama_cpp", "llama_cpp_pld")
    plain, pld = fake_llama_cpp.made
    assert plain.model_path == str(gguf) and plain.n_threads == torch.get_num_threads()
    assert plain.draft_model is None and pld.draft_model.num_pred_tokens == anchors.PROMPT_LOOKUP_NUM_TOKENS
    assert pld.logits_all and not plain.logits_all     # the binding's draft loop needs every position's logits

    tokens, stats = a.run("llama_cpp", [1, 2, 3], 5, 0.0, 7)
    assert tokens == [11, 12, 13, 14, 15] and stats["tokens"] == 5 and stats["method"] == "llama_cpp"
    assert plain.calls[:2] == ["reset", ("seed", 7)]          # a fresh KV cache every run
    _, ids, knobs = plain.calls[2]
    assert ids == [1, 2, 3] and knobs["temp"] == 0.0 and knobs["min_p"] == 0.0 and knobs["repeat_penalty"] == 1.0

    eos = smollm2.eos_token_ids[0]
    monkeypatch.setattr(FakeLlama, "script", [11, eos, 12])
    tokens, _ = a.run("llama_cpp_pld", [1], 5, 0.0, 0)
    assert tokens == [11, eos]                                 # EOS ends the run and is kept, as in decode


def test_llama_cpp_anchor_skips_a_model_that_is_no_gguf_and_records_a_load_failure(smollm2, fake_llama_cpp,
                                                                                    monkeypatch):
    a = anchors.make_anchors(smollm2, None, ("llama_cpp",), None)
    assert a.names == () and a.status["llama_cpp"]["status"] == "skipped"
    assert "GGUF" in a.status["llama_cpp"]["error"]

    def broken(*args, **kwargs):
        raise ValueError("unknown model architecture")
    monkeypatch.setattr(FakeLlama, "__init__", broken)
    a = anchors.make_anchors(smollm2, None, ("llama_cpp",), smollm2.path / "x.gguf")
    assert a.status["llama_cpp"]["status"] == "error" and "unknown model architecture" in a.status["llama_cpp"]["error"]


def test_naming_an_anchor_whose_package_is_missing_says_what_to_install(monkeypatch):
    monkeypatch.setattr(anchors, "_importable", lambda module: module != "llama_cpp")
    with pytest.raises(InputError, match="llama-cpp-python"):
        anchors.parse_anchors("llama_cpp")
    assert anchors.parse_anchors(None) == anchors.HF_ANCHORS      # the default: what is installed
    with pytest.raises(InputError, match="unknown anchor"):
        anchors.parse_anchors("vllm")


def test_graft_bench_puts_llama_cpp_beside_ar_on_the_registry_gguf(smollm2, fake_llama_cpp, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "hi", "category": "chat", "prompt": "Say hi."}) + "\n")
    out = tmp_path / "out.json"
    rc = main(["--model", "smollm2-135m", "--methods", "ar", "--prompts", str(prompts), "--max-new-tokens", "3",
               "--anchors", "llama_cpp", "--dtype", "fp32", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["anchors"] == {"llama_cpp": {"status": "ok"}}
    assert fake_llama_cpp.made[0].model_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    row = next(r for r in report["runs"] if r["method"] == "llama_cpp")
    assert row["kind"] == "anchor" and row["output"] == [11, 12, 13] and row["exact"] is None
    assert "| all | llama_cpp |" in capsys.readouterr().out


def test_an_anchors_first_token_time_is_reported_as_its_prefill():
    """llama.cpp's anchors time their first token, so the table gives them a time to first token
    and a speed after it beside ours."""
    from graft_tk.bench.anchors import _timed
    from graft_tk.bench.compare import decode_rate
    _, stats = _timed("llama_cpp", [5, 6, 7], 2.0, first_token_s=0.5)
    assert stats["prefill_seconds"] == 0.5 and decode_rate(stats) == pytest.approx(2 / 1.5)
    _, untimed = _timed("hf_greedy", [5, 6, 7], 2.0)
    assert "prefill_seconds" not in untimed and decode_rate(untimed) is None
