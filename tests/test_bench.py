"""graft-bench end to end on SmolLM2 (tiny runs: the numbers are not judged, the report is)."""
import json
import os

import pytest

from graft_tk.bench import compare as bench
from graft_tk.cli._models import load_drafter
from graft_tk.cli.bench import main
from graft_tk.methods import METHODS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def two_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": "hi", "category": "chat", "prompt": "Say hi to a friend."},
            {"id": "add", "category": "code", "prompt": "Write a Python function that adds two numbers."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_tiny_run_writes_json_table_and_png(smollm2, two_prompts, tmp_path, capsys):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    rc = main(["--model", "smollm2-135m", "--drafter", "self:10", "--methods", "ar,graft", "--prompts",
               str(two_prompts), "--max-new-tokens", "6", "--json", str(out), "--plot", str(png),
               "--no-anchors", "--dtype", "fp32"])
    stdout = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out.read_text())
    assert {"machine", "config", "prompts", "runs", "summary"} <= set(report)
    assert report["machine"]["torch"] and report["machine"]["graft_tk"] and report["machine"]["date"]
    assert report["config"]["graft"]["budget"] == 16 and report["config"]["methods"] == ["ar", "graft"]
    assert [p["id"] for p in report["prompts"]] == ["hi", "add"]
    assert {(r["prompt"], r["method"]) for r in report["runs"]} == {(p, m) for p in ("hi", "add")
                                                                     for m in ("ar", "graft")}
    assert all(r["exact"] for r in report["runs"])              # greedy fp32: every output equals ar's
    assert all(0 < len(r["output"]) <= 6 for r in report["runs"])
    summary = report["summary"]
    assert list(summary) == ["all", "chat", "code"]
    graft = summary["all"]["graft"]
    assert graft["exact"] == {"compared": 2, "mismatches": 0}
    assert graft["mat"] >= 1.0 and graft["speedup"] > 0 and set(graft["time_split"]) == set(bench.PHASES)
    assert summary["all"]["ar"]["speedup"] == 1.0
    # the markdown table: header, separator, one row per (category, method)
    main_part, acceptance = stdout.split("acceptance estimates vs observed")
    table = [line for line in main_part.splitlines() if line.startswith("|")]
    assert table[0].startswith("| category | method |") and len(table) == 2 + 3 * 2
    # then the estimates' prediction against the accepted count, per source of graft's trees
    rows = [line for line in acceptance.splitlines() if line.startswith("| graft |")]
    assert {line.split("|")[2].strip() for line in rows} == set(summary["all"]["graft"]["expected_accepted_per_step"])
    assert any(line.startswith("| all | graft |") and "2/2" in line for line in table)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_malformed_prompt_file_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "broken"\n')
    rc = main(["--model", "smollm2-135m", "--methods", "ar", "--prompts", str(bad), "--no-anchors"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and "not valid JSON" in err


def test_unknown_method_lists_the_available_ones(capsys):
    rc = main(["--model", "smollm2-135m", "--methods", "ar,nope", "--no-anchors"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown method(s) nope" in err and all(m in err for m in METHODS)


def test_speculative_method_without_a_drafter_is_a_clear_error(smollm2, two_prompts, capsys):
    rc = main(["--model", "smollm2-135m", "--methods", "graft", "--prompts", str(two_prompts), "--no-anchors",
               "--dtype", "fp32"])
    assert rc == 2 and "need a drafter" in capsys.readouterr().err


def test_hf_greedy_anchor_runs_beside_ar(smollm2, two_prompts, tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = main(["--model", "smollm2-135m", "--methods", "ar", "--prompts", str(two_prompts), "--n-per-category",
               "1", "--max-new-tokens", "4", "--anchors", "hf_greedy", "--dtype", "fp32", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["anchors"] == {"hf_greedy": {"status": "ok"}}
    hf = [r for r in report["runs"] if r["method"] == "hf_greedy"]
    assert len(hf) == 2 and all(r["kind"] == "anchor" and r["exact"] for r in hf)
    assert report["summary"]["all"]["hf_greedy"]["mat"] is None
    assert "| all | hf_greedy |" in capsys.readouterr().out


def test_a_failing_anchor_is_recorded_and_skipped(smollm2, two_prompts, tmp_path, monkeypatch, capsys):
    def broken(self, name, *args):
        raise RuntimeError("no such generate feature")
    monkeypatch.setattr("graft_tk.bench.anchors.HFAnchors.run", broken)
    out = tmp_path / "out.json"
    rc = main(["--model", "smollm2-135m", "--methods", "ar", "--prompts", str(two_prompts), "--n-per-category",
               "1", "--max-new-tokens", "2", "--anchors", "hf_greedy", "--dtype", "fp32", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["anchors"]["hf_greedy"]["status"] == "error"
    assert "no such generate feature" in report["anchors"]["hf_greedy"]["error"]
    assert {r["method"] for r in report["runs"]} == {"ar"}
    assert "anchor hf_greedy error" in capsys.readouterr().err


def test_parse_methods_puts_ar_first_and_dedups():
    assert bench.parse_methods("graft,ar,tree,graft") == ("ar", "graft", "tree")
    assert bench.parse_methods("retrieval") == ("ar", "retrieval")


def _row(prompt, category, method, tok_s, exact, **stats):
    kind = "anchor" if method.startswith("hf_") else "ours"
    return {"prompt_index": int(prompt[1:]), "prompt": prompt, "category": category, "method": method,
            "kind": kind, "tokens_per_s": tok_s, "exact": exact, "stats": {"seconds": 1.0, **stats}}


def test_summary_pools_counts_and_marks_mismatches(tmp_path):
    spec = dict(steps=10, mat=2.0, drafter_forwards_per_step=3.0, accepted_by_source={"draft": 6, "retrieval": 4},
                accepted_by_source_depth={"draft": {1: 4, 2: 2}, "retrieval": {3: 4}},
                expected_accepted_by_source={"draft": 7.0, "retrieval": 8.0},
                expected_accepted_by_source_depth={"draft": {1: 5.0, 2: 2.0}, "retrieval": {3: 8.0}},
                time_split={"draft": 0.2, "retrieve": 0.1, "verify": 0.5, "commit": 0.1}, prefill_seconds=0.1)
    rows = [_row("p1", "a", "ar", 10.0, True, steps=8, mat=1.0, tokens=11, prefill_seconds=0.5),
            _row("p2", "b", "ar", 20.0, True, steps=8, mat=1.0, tokens=21, prefill_seconds=0.5),
            _row("p1", "a", "graft", 30.0, True, tokens=31, **spec),
            _row("p2", "b", "graft", 30.0, False, **{**spec, "steps": 30, "tokens": 31}),
            _row("p1", "a", "hf_greedy", 5.0, True), _row("p2", "b", "hf_greedy", 10.0, True)]
    summary = bench.summarize(rows)
    g = summary["all"]["graft"]
    assert g["speedup"] == pytest.approx(2.25)                  # median of 3.0x and 1.5x, paired per prompt
    assert g["accepted_per_step"] == {"draft": 12 / 40, "retrieval": 8 / 40}
    assert g["accepted_per_step_by_source_depth"] == {"draft": {1: 8 / 40, 2: 4 / 40}, "retrieval": {3: 8 / 40}}
    assert g["expected_per_step_by_source_depth"] == {"draft": {1: 10 / 40, 2: 4 / 40}, "retrieval": {3: 16 / 40}}
    # observed / expected per source, and per depth: retrieval got half its estimate at depth 3
    assert "| graft | retrieval | 0.400 | 0.200 | 0.50 | 3: 0.20/0.40 |" in bench.acceptance_table(summary)
    assert g["exact"] == {"compared": 2, "mismatches": 1} and summary["b"]["graft"]["exact"]["mismatches"] == 1
    assert summary["all"]["hf_greedy"]["speedup"] == 0.5 and summary["all"]["hf_greedy"]["mat"] is None
    table = bench.markdown_table(summary)
    # after the prefill: 30 tokens in 0.9 s against ar's 10 in 0.5 s and 20 in 0.5 s: 1.67x and 0.83x
    assert g["decode_speedup"] == pytest.approx(1.25) and summary["all"]["hf_greedy"]["decode_speedup"] is None
    assert "| all | graft | 2 | 30.00 | 2.25x | 1.25x | 0.10 | 2.00 |" in table and "1/2 **1 MISMATCH**" in table
    assert g["first_token_s"] == pytest.approx(0.1) and summary["all"]["ar"]["first_token_s"] == 0.5
    assert summary["all"]["hf_greedy"]["first_token_s"] is None   # HF's generate reports none
    assert "10/20/10/50/10" in table                             # time split, percent of the run
    assert "n.a. (sampling)" in bench.markdown_table(bench.summarize(
        [{**r, "exact": None} for r in rows]), temperature=0.7)
    from graft_tk.bench.plots import plot_summary
    plot_summary(summary, tmp_path / "s.png")                    # anchors without MAT, two categories
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC


def test_compile_both_runs_every_method_eager_and_compiled(smollm2, monkeypatch):
    from graft_tk.compiled import Compile
    from graft_tk.config import GraftConfig
    from graft_tk.errors import InputError
    from graft_tk.bench.prompts import Prompt
    prompts = [Prompt("hi", "chat", "Say hi.")]
    both = bench.BENCH_COMPILE_MODES["both"]
    plan = bench.Plan(smollm2, None, GraftConfig(), ("ar", "retrieval"), prompts, 4, compile=both)
    assert plan.run_names == ("ar", "retrieval", "ar:compiled", "retrieval:compiled")
    calls = []
    monkeypatch.setattr(bench, "cold_decode", lambda t, d, method, *a: calls.append((method, a[-2])) or ([], {}))
    for name in plan.run_names:
        plan.run_once(name, [1, 2], 4)
    assert calls == [("ar", Compile.OFF), ("retrieval", Compile.OFF), ("ar", Compile.ON), ("retrieval", Compile.ON)]
    calls.clear()                # --compile drafter: every run compiles only the drafter model
    plan_d = bench.Plan(smollm2, None, GraftConfig(), ("ar", "retrieval"), prompts, 4,
                        compile=bench.BENCH_COMPILE_MODES["drafter"])
    for name in plan_d.run_names:
        plan_d.run_once(name, [1, 2], 4)
    assert plan_d.run_names == ("ar", "retrieval")
    assert calls == [("ar", Compile.DRAFTER), ("retrieval", Compile.DRAFTER)]
    # the untimed warm-up: a few tokens eager, the whole first prompt compiled (every graph built)
    warmups = []

    class TimedRunStarted(Exception):
        pass

    def record(plan_, name, ids, max_new_tokens):
        if len(warmups) == len(plan.run_names):
            raise TimedRunStarted
        warmups.append((name, max_new_tokens))
    monkeypatch.setattr(bench, "_guarded", record)
    plan = bench.Plan(smollm2, None, GraftConfig(), ("ar", "retrieval"), prompts, 20, compile=both)
    with pytest.raises(TimedRunStarted):
        bench.run(plan)
    assert warmups == [("ar", bench.WARMUP_TOKENS), ("retrieval", bench.WARMUP_TOKENS), ("ar:compiled", 20),
                       ("retrieval:compiled", 20)]
    with pytest.raises(InputError, match="--compile"):
        bench.Plan(smollm2, None, GraftConfig(), ("ar",), prompts, 4, compile=("yes",))


def test_adaptive_both_runs_each_pruning_method_fixed_and_adaptive(smollm2):
    from graft_tk.bench.prompts import Prompt
    from graft_tk.config import GraftConfig
    from graft_tk.cost import StepCost
    cost = StepCost(verify_ms=tuple(10.0 + i for i in range(16)), draft_ms=(3.0,) * 16, step_ms=1.0)
    prompts = [Prompt("hi", "chat", "Say hi.")]
    plan = bench.Plan(smollm2, smollm2, GraftConfig(cost=cost), ("ar", "tree", "graft"), prompts, 4,
                      adaptive=bench.ADAPTIVE_MODES["both"], configs={"other": GraftConfig()})
    assert plan.run_names == ("ar", "tree", "graft", "graft:adaptive", "tree@other", "graft@other")
    runs = {r.name: r for r in plan.runs}
    assert runs["graft:adaptive"].adaptive and not runs["graft"].adaptive and runs["graft@other"].config == "other"
    only = bench.Plan(smollm2, smollm2, GraftConfig(cost=cost), ("ar", "graft"), prompts, 4,
                      adaptive=bench.ADAPTIVE_MODES["on"])
    assert only.run_names == ("ar", "graft") and [r.adaptive for r in only.runs] == [False, True]


def test_prompt_sources_mix_and_mt_bench_round_robin(tmp_path):
    from graft_tk.bench.prompts import load_prompts, spec_bench_path
    assert [p.category for p in load_prompts("math#2,humaneval#1")] == ["math", "math", "humaneval"]
    mine = tmp_path / "mine.jsonl"     # a file of one's own keeps its categories (math is an MT-bench topic too)
    mine.write_text('{"category": "math", "prompt": "1 + 1?"}\n{"prompt": "Hi"}\n')
    assert [p.category for p in load_prompts(str(mine))] == ["math", "custom"]
    if spec_bench_path() is None and os.environ.get("GRAFT_TK_REQUIRE_DATA") != "1":
        pytest.skip("Spec-Bench's question.jsonl not found (GRAFT_TK_SPEC_BENCH)")
    # MT-bench questions 81-160, 10 per category: #K takes them one category at a time
    assert [p.id for p in load_prompts("mt-bench#9")] == ["81", "91", "101", "111", "121", "131", "141", "151", "82"]
    assert len(load_prompts("mt-bench")) == 80 and {p.category for p in load_prompts("mt-bench")} == {"mt_bench"}


def test_the_long_set_builds_offline_with_each_tasks_answer_length(smollm2):
    from graft_tk.bench.prompts import load_prompts
    from graft_tk.decode import encode_prompt
    from graft_tk.errors import InputError
    prompts = load_prompts("long@1k+2k")
    assert [p.category for p in prompts[:5]] == ["code-edit@1k"] * 2 + ["document@1k"] * 2 + ["conversation@1k"]
    assert {p.category.partition("@")[2] for p in prompts} == {"1k", "2k"}
    assert all(p.max_new_tokens for p in prompts) and load_prompts("long@1k") == prompts[:5]   # deterministic
    rename, conversation = prompts[0], prompts[4]
    assert "```python" in rename.text and "def " in rename.text and rename.max_new_tokens == 512
    assert conversation.history and conversation.history[1][1] in rename.text      # the module, an earlier turn
    lengths = {p.id: len(encode_prompt(smollm2, p.chat, chat=True)) for p in prompts}
    assert all(600 <= n <= 1600 for i, n in lengths.items() if "/1k/" in i), lengths     # about the size asked
    assert all(1400 <= n <= 2800 for i, n in lengths.items() if "/2k/" in i), lengths
    with pytest.raises(InputError, match="context size"):
        load_prompts("long@3k")
    # a conversation goes through the chat template, every turn in it
    ids = encode_prompt(smollm2, conversation.chat, chat=True)
    assert smollm2.tokenizer.decode(ids).count(conversation.history[0][1]) == 1
    with pytest.raises(InputError, match="ending with the user's"):
        encode_prompt(smollm2, conversation.chat[:2], chat=True)


def test_a_prompts_own_answer_length_is_used_unless_the_run_sets_one(smollm2):
    from graft_tk.config import GraftConfig
    from graft_tk.bench.prompts import Prompt
    own, plain = Prompt("a", "x", "Hi.", max_new_tokens=7), Prompt("b", "x", "Hi.")
    plan = bench.Plan(smollm2, None, GraftConfig(), ("ar",), [own, plain], None)
    assert (plan.new_tokens(own), plan.new_tokens(plain)) == (7, bench.DEFAULT_NEW_TOKENS)
    fixed = bench.Plan(smollm2, None, GraftConfig(), ("ar",), [own, plain], 3)
    assert (fixed.new_tokens(own), fixed.new_tokens(plain)) == (3, 3)


def test_a_named_profile_runs_beside_the_methods(smollm2, two_prompts, tmp_path, capsys):
    from graft_tk.profiles import profile_key, write_profile
    from graft_tk.config import GraftConfig
    drafter = load_drafter("self:10", smollm2, "smollm2-135m")
    path = write_profile(profile_key(smollm2, drafter), "graft", GraftConfig(budget=4, max_depth=1), {}, tmp_path)
    out = tmp_path / "out.json"
    assert main(["--model", "smollm2-135m", "--drafter", "self:10", "--methods", "ar,graft", "--prompts",
                 str(two_prompts), "--max-new-tokens", "6", "--json", str(out), "--no-anchors", "--dtype", "fp32",
                 "--config", f"small={path}"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert {r["method"] for r in runs} == {"ar", "graft", "graft@small"} and all(r["exact"] for r in runs)
    for r in runs:     # graft@small ran with the profile's config: one drafter depth, at most 4 nodes
        if r["method"] == "graft@small":
            assert r["stats"]["config"]["budget"] == 4 and r["stats"]["drafter_forwards_per_step"] <= 1
            assert max(r["stats"]["per_step"]["nodes"]) <= 4
        elif r["method"] == "graft":
            assert r["stats"]["config"]["budget"] == 16
    capsys.readouterr()
    assert main(["--model", "smollm2-135m", "--methods", "ar", "--config", "oops"]) == 2
    assert "expected NAME=PROFILE.json" in capsys.readouterr().err
    assert main(["--model", "smollm2-135m", "--methods", "ar", "--config", f"x={tmp_path / 'none.json'}"]) == 2
    assert "no file" in capsys.readouterr().err


def test_serve_load_reports_first_token_and_per_token_latency(smollm2, tmp_path):
    """serve_load's table and JSON carry p50 / p99 time to first token and per-token latency per
    (B, method), measured at the server (every request's first token, every token's share of its step)."""
    from graft_tk.bench import serve_load
    out = tmp_path / "load.json"
    # a short prompt and a 1k-token conversation (its earlier turns sent as messages), read 128 tokens a step
    # 3 clients of a server that batches 2 (as graft-serve's default batch serves more clients)
    assert serve_load.main(["--model", "smollm2-135m", "--methods", "ar,retrieval+pld", "--batches", "3",
                            "--max-batch", "2", "--prompts", "humaneval#1,long@1k#1", "--requests-per-cell", "3",
                            "--max-tokens", "6", "--dtype", "fp32", "--prefill-chunk", "128", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"ar", "retrieval+pld"} and all(r["same_as_reference"] for r in rows)
    assert all(r["batch"] == 3 and r["max_batch"] == 2 and r["peak_batch"] <= 2 and r["requests"] == 3 for r in rows)
    for r in rows:
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["latency_p95_s"] + 1e-9
        assert 0 < r["token_p50_ms"] <= r["token_p99_ms"] <= 1000 * r["chunk_wait_max_s"] + 1e-6
    assert serve_load.percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0 and serve_load.percentile([5.0], 0.99) == 5.0


def test_serve_load_open_loop_sends_on_a_seeded_poisson_schedule(smollm2, tmp_path):
    """--arrival-rate: requests arrive at the times of a seeded Poisson process (the same for every
    server), each streamed on its own while others run; answers equal ar's."""
    from graft_tk.bench import serve_load
    times = serve_load.poisson_arrivals(2.0, 400, seed=3)
    assert times == serve_load.poisson_arrivals(2.0, 400, seed=3) != serve_load.poisson_arrivals(2.0, 400, seed=4)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert all(g > 0 for g in gaps) and 0.4 < sum(gaps) / len(gaps) < 0.6      # a mean gap of 1 / rate
    out = tmp_path / "open.json"
    assert serve_load.main(["--model", "smollm2-135m", "--methods", "ar,retrieval+pld", "--batches", "1,2",
                            "--prompts", "humaneval#3", "--requests-per-cell", "3", "--max-tokens", "8",
                            "--dtype", "fp32", "--arrival-rate", "20", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(r["same_as_reference"] and r["requests"] == 3 for r in rows)
    assert all(r["output_tokens"] > 0 and r["ttft_p50_s"] > 0 for r in rows)
    assert max(r["peak_batch"] for r in rows if r["batch"] == 2) == 2     # at 20 a second they overlap
    with pytest.raises(SystemExit):
        serve_load.main(["--model", "smollm2-135m", "--arrival-rate", "0"])


def test_batch_decode_compares_methods_decoding_in_one_batch(tmp_path, capsys):
    from bench import batch_decode
    out = tmp_path / "batch.json"
    assert batch_decode.main(["--model", "smollm2-135m", "--dtype", "fp32", "--drafter", "self:10", "--batch", "2",
                              "--methods", "ar,graft", "--prompts", "humaneval#2", "--max-new-tokens", "6",
                              "--rounds", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["ar", "graft"] and rows[0]["vs_first"] == 1.0
    assert all(r["median"] > 0 for r in rows)
    assert rows[0]["steps"]["speculating"] == rows[0]["steps"]["drafting"] == 0 and rows[0]["steps"]["plain"] >= 1
    assert "| graft |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        batch_decode.main(["--methods", "ar,nonsense"])


def test_a_failed_client_request_comes_back_as_an_error_that_unpickles():
    """openai's errors do not unpickle, so one failed request of a client process killed the
    pool's result thread and serve_load hung; it now raises a RuntimeError naming the request."""
    import pickle

    from graft_tk.bench import serve_load
    prompts = [[{"role": "user", "content": "hi"}]]
    with pytest.raises(RuntimeError, match="server 0, prompt 0: APIConnectionError") as caught:
        serve_load.run_client(["http://127.0.0.1:9/v1"], prompts, 0, 1, 4)       # nothing listens on port 9
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)
