"""graft_tk.autotune: the cache file, the lookup policy, tuning and the CLI's file commands.

Runs without a GPU: a toy kernel with two configs is "benchmarked" by a fake timer that returns
chosen times and counts its calls (it also launches the kernel once per config under the
interpreter, so every config it times really runs). The tree-attention candidates are checked
for correctness under the interpreter; their GPU timing runs only where CUDA is.
"""
import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import graft_tk.kernels  # noqa: F401, I001  (first: sets TRITON_INTERPRET before triton.language is imported)
import triton
import triton.language as tl

from graft_tk.autotune import AutotuneWarning, Tunable, cache, resolve, select, tuner
from graft_tk.autotune import tree_attention as ta_tunable
from graft_tk.cli import autotune as cli
from graft_tk.kernels._common import next_pow2
from graft_tk.kernels.tree_attention import _launch, block_sizes, shape_bucket
from graft_tk.reference.tree_attention import tree_attention as tree_attention_torch

from .tolerances import KERNEL_TOL

REPO = Path(__file__).resolve().parents[1]


@triton.jit
def _toy_double_kernel(X, Out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(Out + offs, tl.load(X + offs, mask=ok) * 2, mask=ok)


class FakeTimer:
    """A benchmark that runs the toy kernel once with ``config`` and reports ``times[BLOCK]`` ms."""

    def __init__(self, times: dict):
        self.times, self.calls = times, 0

    def __call__(self, bucket: str, config: dict) -> float:
        self.calls += 1
        n = tuner.parse_bucket(bucket)["n"]
        x = torch.arange(n, dtype=torch.float32)
        out = torch.empty_like(x)
        _toy_double_kernel[(triton.cdiv(n, config["BLOCK"]),)](x, out, n, **config)
        assert torch.equal(out, 2 * x)
        return self.times[config["BLOCK"]]


def _real_timer_not_in_tests(bucket, config):
    raise AssertionError("tests inject a FakeTimer")


TOY = Tunable(name="toy_double", kernel=_toy_double_kernel, bucket=lambda n: f"n={next_pow2(n)}",
              configs=lambda bucket: [{"BLOCK": 16}, {"BLOCK": 64}], heuristic=lambda bucket: {"BLOCK": 16},
              benchmark=_real_timer_not_in_tests)
HEURISTIC = {"BLOCK": 16}
OTHER_GPU = dict(gpu="NVIDIA H100 80GB HBM3", capability="9.0")


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("GRAFT_TK_AUTOTUNE_CACHE", str(path))
    return path


def _tuned(bucket="n=256", times=None) -> FakeTimer:
    timer = FakeTimer(times or {16: 2.0, 64: 1.0})
    assert resolve(TOY, bucket, HEURISTIC, tune_on_miss=True, benchmark=timer) == {"BLOCK": 64}
    return timer


def _entry(bucket="n=256", tuned_at="2025-01-01T00:00:00+00:00", **key_changes) -> cache.Entry:
    key = dataclasses.replace(tuner.key_for(TOY, bucket), **key_changes)
    return cache.Entry(key=key, config={"BLOCK": 64}, time_ms=1.0, heuristic_ms=2.0, tuned_at=tuned_at)


# --------------------------------------------------------------------------- tune, persist, look up
def test_tuning_picks_the_fastest_config_and_persists_it(cache_file):
    timer = _tuned()
    assert timer.calls == 2                         # each config once; the heuristic is one of them
    doc = json.loads(cache_file.read_text())
    assert doc["format"] == "graft_tk.autotune/1" and len(doc["entries"]) == 1
    entry = doc["entries"][0]
    assert entry["config"] == {"BLOCK": 64} and entry["time_ms"] == 1.0 and entry["heuristic_ms"] == 2.0
    env = cache.environment()
    assert entry["key"] == dict(kernel="toy_double", bucket="n=256", source_hash=tuner.source_hash(_toy_double_kernel),
                                **dataclasses.asdict(env))
    # A hit in the same process: no benchmark either.
    assert resolve(TOY, "n=256", HEURISTIC, tune_on_miss=True, benchmark=timer) == {"BLOCK": 64}
    assert timer.calls == 2


def test_next_process_uses_the_entry_without_benchmarking(cache_file):
    _tuned()
    code = ("import json; from graft_tk.autotune import resolve; from tests.test_autotune import TOY, FakeTimer; "
            "t = FakeTimer({16: 2.0, 64: 1.0}); "
            "print(json.dumps([resolve(TOY, 'n=256', {'BLOCK': 16}, tune_on_miss=True, benchmark=t), t.calls]))")
    # the same threads as this process: on a CPU they are part of the key
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "GRAFT_TK_AUTOTUNE_CACHE": str(cache_file),
                            "OMP_NUM_THREADS": str(torch.get_num_threads())})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [{"BLOCK": 64}, 0]


def test_a_miss_without_tuning_is_the_heuristic(cache_file):
    timer = FakeTimer({16: 2.0, 64: 1.0})
    assert resolve(TOY, "n=256", HEURISTIC, tune_on_miss=False, benchmark=timer) == HEURISTIC
    assert timer.calls == 0 and not cache_file.exists()


def test_cpu_and_interpreter_use_heuristics_without_reading_the_cache(cache_file, monkeypatch):
    cache_file.write_text("{corrupt")          # a read would warn
    monkeypatch.setenv("GRAFT_TK_AUTOTUNE", "1")  # and a miss would tune
    bucket = shape_bucket(54, 128, 1000, torch.bfloat16)
    heuristic = block_sizes(54, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select("tree_attention", bucket, heuristic, torch.device("cpu")) is heuristic


def test_a_gpu_resolves_each_bucket_once_per_process(monkeypatch):
    """Every layer launches the attention kernel: the cache is consulted once per (kernel, bucket,
    device), not once per launch (no file stat in the hot loop)."""
    calls = []

    def fake_resolve(tunable, bucket, heuristic, *, tune_on_miss, env):
        calls.append(bucket)
        return {"BLOCK_M": 32}

    monkeypatch.setattr(tuner, "interpreted", lambda: False)
    monkeypatch.setattr(tuner, "resolve", fake_resolve)
    monkeypatch.setattr(tuner.cache, "environment", lambda index: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuner, "_SELECTED", {})
    gpu0, gpu1 = SimpleNamespace(type="cuda", index=0), SimpleNamespace(type="cuda", index=1)
    for _ in range(3):
        for bucket in ("a", "b"):
            assert select("tree_attention", bucket, {"BLOCK_M": 16}, gpu0) == {"BLOCK_M": 32}
    select("tree_attention", "a", {"BLOCK_M": 16}, gpu1)
    assert calls == ["a", "b", "a"]


def test_source_hash_ignores_decorators_and_changes_with_the_source():
    src_hash = tuner.source_hash(_toy_double_kernel)
    assert src_hash == tuner.source_hash(_toy_double_kernel.fn)   # compiled or interpreted: the same key
    assert src_hash != tuner.source_hash(ta_tunable.TUNABLE.kernel)


# --------------------------------------------------------------------------- stale, other GPU, corrupt
@pytest.mark.parametrize("field", ["source_hash", "triton", "torch", "graft_tk"])
def test_version_or_source_mismatch_is_rejected(cache_file, field):
    cache.write_entries(cache_file, [_entry(**{field: "0.0-other"})])
    timer = FakeTimer({16: 2.0, 64: 1.0})
    with pytest.warns(AutotuneWarning, match=f"stale .*{field} '0.0-other'"):
        assert resolve(TOY, "n=256", HEURISTIC, tune_on_miss=False, benchmark=timer) == HEURISTIC
    assert timer.calls == 0


def test_other_gpu_entries_are_kept_but_never_applied(cache_file, tmp_path, capsys):
    shared = tmp_path / "from-h100.json"
    cache.write_entries(shared, [_entry(**OTHER_GPU)])
    assert cli.main(["import", str(shared)]) == 0
    assert "1 other-GPU" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # another GPU's entry is not stale: no warning either
        assert resolve(TOY, "n=256", HEURISTIC, tune_on_miss=False) == HEURISTIC
    _tuned()                                         # tuning here adds this GPU's entry beside it
    gpus = sorted(e.key.gpu for e in cache.read_entries(cache_file, strict=True))
    assert gpus == sorted([OTHER_GPU["gpu"], cache.environment().gpu])


@pytest.mark.parametrize("content,match", [
    ("{not json", "unreadable"),
    ('{"format": "graft_tk.autotune/0", "entries": []}', "not a graft_tk.autotune/1 document"),
    ('{"format": "graft_tk.autotune/1", "entries": [{"key": {"kernel": "toy_double"}}]}', "entry #0 is malformed"),
])
def test_corrupt_cache_warns_and_falls_back(cache_file, content, match):
    cache_file.write_text(content)
    with pytest.warns(AutotuneWarning, match=match):
        assert resolve(TOY, "n=256", HEURISTIC, tune_on_miss=False) == HEURISTIC
    with pytest.warns(AutotuneWarning, match=match):
        _tuned()                                     # tuning replaces the corrupt file with a valid one
    assert len(cache.read_entries(cache_file, strict=True)) == 1


def test_a_malformed_entry_does_not_hide_the_good_ones(cache_file):
    doc = {"format": cache.FORMAT, "entries": [{"key": {}, "config": {}}, _entry().to_json()]}
    cache_file.write_text(json.dumps(doc))
    with pytest.warns(AutotuneWarning, match="entry #0 is malformed"):
        assert resolve(TOY, "n=256", HEURISTIC, tune_on_miss=False) == {"BLOCK": 64}


# --------------------------------------------------------------------------- export / import / merge
def test_export_import_merge_round_trip(cache_file, tmp_path, capsys):
    _tuned("n=256")
    _tuned("n=1024")
    exported = tmp_path / "team.json"
    assert cli.main(["export", str(exported)]) == 0
    tuned = cache.read_entries(cache_file, strict=True)
    assert cache.read_entries(exported, strict=True) == tuned

    assert cli.main(["clear"]) == 0 and cache.read_entries(cache_file, strict=True) == []
    assert cli.main(["import", str(exported)]) == 0
    assert cache.read_entries(cache_file, strict=True) == tuned
    assert resolve(TOY, "n=256", HEURISTIC, tune_on_miss=False) == {"BLOCK": 64}

    # merge: union by key; on a shared key the later tuned_at wins, whichever file it is in.
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    newer = dataclasses.replace(_entry("n=256", tuned_at="2030-01-01T00:00:00+00:00"), config={"BLOCK": 16})
    cache.write_entries(a, [newer, _entry("n=4096", **OTHER_GPU)])
    cache.write_entries(b, tuned)
    assert cli.main(["merge", str(a), str(b), "-o", str(out)]) == 0
    merged = {(e.key.bucket, e.key.gpu): e for e in cache.read_entries(out, strict=True)}
    assert len(merged) == 3 and merged[("n=256", cache.environment().gpu)] == newer
    capsys.readouterr()


def test_import_of_a_corrupt_file_is_an_error(cache_file, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "graft_tk.autotune/1", "entries": [{"config": {}}]}')
    assert cli.main(["import", str(bad)]) == 2
    assert "entry #0 is malformed" in capsys.readouterr().err and not cache_file.exists()
    assert cli.main(["export", str(tmp_path / "x.json")]) == 2   # nothing to export
    assert "nothing to export" in capsys.readouterr().err


def test_show_marks_usable_stale_and_other_gpu(cache_file, capsys):
    t = ta_tunable.TUNABLE
    bucket = t.bucket(rows=54, head_dim=128, kv_len=1000)
    usable = cache.Entry(key=tuner.key_for(t, bucket), config=t.heuristic(bucket), time_ms=0.05,
                         heuristic_ms=0.05, tuned_at=cache.now())
    cache.write_entries(cache_file, [usable,
                                     dataclasses.replace(usable, key=dataclasses.replace(usable.key, triton="0.0")),
                                     dataclasses.replace(usable, key=dataclasses.replace(usable.key, **OTHER_GPU))])
    assert cli.main(["show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "3 entries" in lines[0] and "STATUS" in lines[1]
    assert sorted(line.split()[-1] for line in lines[2:]) == ["other-GPU", "stale", "usable"]
    assert all("rows=64,head_dim=128,kv_len=1024,dtype=bfloat16" in line for line in lines[2:])


def test_cli_tune_flow(cache_file, monkeypatch, capsys):
    """tune's flow on a faked GPU (the toy kernel, a fake timer): --shapes rounded to buckets, tuned vs
    heuristic per bucket, and a rerun that finds them cached."""
    cache.environment()                              # memoised now, while CUDA is really absent
    timer = FakeTimer({16: 2.0, 64: 1.0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner, "get_tunable", lambda name: dataclasses.replace(TOY, benchmark=timer))
    argv = ["tune", "--kernels", "toy_double", "--shapes", "n=200", "n=256", "n=1000"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert timer.calls == 4                           # n=200 and n=256 share a bucket
    assert "toy_double n=256: tuned BLOCK=64 1.0000 ms vs heuristic 2.0000 ms (2.00x)" in out
    assert "toy_double n=1024: tuned" in out
    assert cli.main(argv) == 0
    assert "toy_double n=1024: cached BLOCK=64" in capsys.readouterr().out and timer.calls == 4
    assert cli.main(["tune", "--kernels", "toy_double", "--shapes", "m=3"]) == 2
    assert "--shapes {'m': 3}" in capsys.readouterr().err


# --------------------------------------------------------------------------- concurrency
def _writer(path: str, tag: str, n: int, barrier) -> None:
    barrier.wait()
    for i in range(n):
        cache.update([_entry(f"n={tag}{i}")], Path(path))


def test_two_concurrent_writers_leave_a_valid_file(cache_file):
    """Two processes each add 20 entries at once: without the lock, read-merge-write loses entries."""
    ctx = multiprocessing.get_context("fork")        # the parent's imports, no second torch start-up
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(str(cache_file), tag, 20, barrier)) for tag in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    buckets = {e.key.bucket for e in cache.read_entries(cache_file, strict=True)}
    assert buckets == {f"n={tag}{i}" for tag in "ab" for i in range(20)}


# --------------------------------------------------------------------------- tree attention
def test_tree_attention_buckets_and_candidates():
    assert shape_bucket(54, 128, 1000, torch.bfloat16) == "rows=64,head_dim=128,kv_len=1024,dtype=bfloat16"
    assert shape_bucket(1, 64, 5, torch.float32) == "rows=16,head_dim=64,kv_len=256,dtype=float32"
    for rows in (1, 6, 54, 70, 500, 5000):
        for d in (64, 256):
            bucket = shape_bucket(rows, d, 3000, torch.float16)
            heuristic = ta_tunable.heuristic(bucket, "cpu")                              # one heuristic per bucket
            assert heuristic == {**block_sizes(rows, d, torch.float16), "KV_SPLITS": 1}   # no SMs: no split
            configs = ta_tunable.configs(bucket)
            assert configs and len({json.dumps(c, sort_keys=True) for c in configs}) == len(configs)
            for c in configs:
                assert all(c[b] & (c[b] - 1) == 0 and c[b] >= 16 for b in ("BLOCK_M", "BLOCK_N"))
    with pytest.raises(ValueError, match="head dim 80"):
        ta_tunable.bucket(rows=4, head_dim=80, kv_len=100)


def test_tree_attention_candidates_fit_sm80_shared_memory():
    """fp32 64 x 128 tiles in 3 stages need 180 KB (compiled: 180,480 B), past sm_80's 163 KB: never
    offered; bf16 tiles all fit (the largest, 128 x 128 at head dim 128, compiles to 114,688 B)."""
    assert ta_tunable.shared_bytes(64, 128, 64, 3, "float32") == 180_224
    assert ta_tunable.shared_bytes(128, 128, 128, 3, "bfloat16") == 114_688
    assert len(ta_tunable.configs(shape_bucket(128, 128, 1024, "bfloat16"))) == 48 * 2
    for dtype in ("float32", "bfloat16"):
        for d in (64, 128, 256):
            configs = ta_tunable.configs(shape_bucket(64, d, 4096, dtype))
            assert configs
            for c in configs:
                assert ta_tunable.shared_bytes(c["BLOCK_M"], c["BLOCK_N"], d, c["num_stages"], dtype) <= 166_912
    fp32 = ta_tunable.configs(shape_bucket(64, 64, 1024, "float32"))
    tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["num_stages"]) for c in fp32}
    assert (64, 128, 2) in tiles and (64, 128, 3) not in tiles


@pytest.mark.parametrize("kv_len,config", [
    (256, dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=3, KV_SPLITS=1)),
    (1024, dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2, KV_SPLITS=4))], ids=["M32-N128", "M16-N32-split4"])
def test_tree_attention_candidate_tiles_are_exact(kv_len, config):
    """Candidates other than the heuristic's tiles compute the same attention (the benchmark input)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bucket = f"rows=32,head_dim=16,kv_len={kv_len},dtype=float32"
    q, k, v, prefix, block, keys, scale = ta_tunable.inputs(bucket, device)
    assert config in ta_tunable.configs(bucket)
    out = torch.empty_like(q)
    _launch(q, k, v, prefix, block, keys, scale, out, config)
    atol, rtol = KERNEL_TOL[torch.float32]
    torch.testing.assert_close(out, tree_attention_torch(q, k, v, prefix, block, keys, scale), atol=atol, rtol=rtol)
