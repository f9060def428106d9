"""bench/gpu_check.py's tree-attention section runs here at toy size (its --dry-run path): the
kernel, its split path and SDPA on the same inputs, and the table. The whole --dry-run (kernel
benchmarks in the interpreter, compiled forwards) takes minutes; it is run by hand (README)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_attention_dry_run(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    sys.modules.pop("gpu_check", None)
    import gpu_check
    rows = gpu_check.run_attention(cuda=False)
    assert len(rows) == 1 and rows[0]["splits"] == 2
    assert not rows[0]["agree"].startswith("DIFFER") and rows[0]["triton_ms"] > 0 and rows[0]["sdpa_ms"] > 0
    table = gpu_check.attention_table(rows)
    assert "| toy | 100 | 4 | " in table and "(2)" in table
