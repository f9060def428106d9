"""Console scripts, run as a user runs them."""
import json
import subprocess
import sys

import pytest
import torch


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, input=stdin, timeout=300)


def test_generate_json(smollm2):
    r = run("graft_tk.cli.generate", "--model", "smollm2-135m", "--dtype", "fp32", "--prompt", "Say hi.",
            "--max-new-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"] == "smollm2-135m" and 0 < len(out["tokens"]) <= 6
    assert out["stats"]["tokens"] == len(out["tokens"]) and out["stats"]["tokens_per_s"] > 0


def test_generate_streams_text_then_stats_from_stdin(smollm2):
    # smollm2 has no paired drafter: the default method is then retrieval+pld, and the user is told
    r = run("graft_tk.cli.generate", "--model", "smollm2-135m", "--max-new-tokens", "8", stdin="Say hi.")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "running retrieval+pld" in r.stderr
    assert "[retrieval+pld]" in r.stderr and "tokens/s" in r.stderr and "tokens per target forward" in r.stderr


def test_generate_runs_graft_by_default_when_there_is_a_drafter(smollm2):
    r = run("graft_tk.cli.generate", "--model", "smollm2-135m", "--drafter", "self:10", "--max-new-tokens", "24",
            "--prompt", "Count from 1 to 30.")
    assert r.returncode == 0, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("[graft] ") and "tokens/s" in last and "accepted per step: " in last, last


def test_generate_unknown_model_exits_2_with_the_list():
    r = run("graft_tk.cli.generate", "--model", "nope", "--prompt", "x")
    assert r.returncode == 2
    assert "unknown model 'nope'" in r.stderr and "smollm2-135m" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_autotune_tune_without_gpu_exits_2(tmp_path):
    r = run("graft_tk.cli.autotune", "--cache", str(tmp_path / "c.json"), "tune")
    assert r.returncode == 2
    assert "tuning tree_attention needs a CUDA GPU" in r.stderr and "--model NAME" in r.stderr
    assert not (tmp_path / "c.json").exists()


def test_autotune_show_and_export_of_an_empty_cache(tmp_path):
    cache = str(tmp_path / "c.json")
    r = run("graft_tk.cli.autotune", "--cache", cache, "show")
    assert r.returncode == 0 and r.stdout.startswith(f"{cache}: 0 entries"), r.stderr
    r = run("graft_tk.cli.autotune", "--cache", cache, "export", str(tmp_path / "out.json"))
    assert r.returncode == 2 and "nothing to export" in r.stderr


def test_generate_verbose_says_which_path_each_op_runs(smollm2):
    r = run("graft_tk.cli.generate", "--model", "smollm2-135m", "--prompt", "Hi", "--max-new-tokens", "2", "-v")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("ops on cpu: "))
    assert all(f"{op} torch reference" in line for op in ("draft_expand", "accept", "tree_attention", "prompt_lookup"))
