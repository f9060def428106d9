"""Every Triton kernel compiles for sm_80 and sm_90 (python -m bench.compile_check --quick), here without a GPU.

The interpreter that runs the kernel tests accepts programs the compiler rejects; this compiles
what a GPU would, with the ptxas inside the triton wheel, in a subprocess (the check needs
TRITON_INTERPRET=0 before graft_tk is imported; this process has the interpreter on)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"_draft_expand_kernel", "_draft_expand_partial_kernel", "_retrieve_kernel", "_build_tree_kernel", "_node_topk_kernel", "_walk_kernel",
           "_write_kernel",
           "_commit_kv_kernel", "_tree_attention_kernel", "_combine_splits_kernel", "_exact_attention_kernel",
           "_prompt_lookup_kernel",
           "_quant_matmul_kernel"}


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90(tmp_path):
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "bench.compile_check", "--quick", "--arch", "80,90",
                          "--json", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert {(r["kernel"], r["arch"]) for r in results} == {(k, a) for k in KERNELS for a in (80, 90)}
    assert all(r["ok"] and r["shared_bytes"] is not None and r["registers"] for r in results)
    assert "| tree_attention_kernel | sm_90 |" in run.stdout
    # A rerun into the same file compiles nothing it already has; a file from another triton is refused.
    again = subprocess.run(run.args, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0 and f"{len(results)} compiles taken from" in again.stderr, again.stderr[-2000:]
    assert "0 to go" in again.stderr and json.loads(out.read_text())["results"] == results
    saved = json.loads(out.read_text())
    out.write_text(json.dumps({**saved, "triton": "0.0"}))
    stale = subprocess.run(run.args, capture_output=True, text=True, env=env, timeout=600)
    assert stale.returncode != 0 and "written by another run (triton: 0.0" in stale.stderr, stale.stderr[-2000:]


def test_a_kernel_that_does_not_compile_is_named(tmp_path):
    # A launch recorded with an argument type the kernel cannot take fails to compile, and the check
    # reports it instead of passing.
    code = f"""
import sys; sys.path.insert(0, {str(ROOT / 'bench')!r})
import dataclasses, compile_check as c
launches = [l for l in c.record_launches(True) if l.kernel == "_retrieve_kernel"]
broken = dataclasses.replace(launches[0], signature=tuple((n, "*fp32" if t.startswith("*i") else t)
                                                           for n, t in launches[0].signature))
r = c.compile_one(broken, 90)
print("OK" if (not r.ok and r.error and r.kernel == "_retrieve_kernel") else "MISSED", r.error)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.stdout.startswith("OK"), run.stdout + run.stderr[-2000:]
