"""bench/gpu_check.py's sections at toy size (its --dry-run path): the tree attention (kernel, split
path, SDPA on the same inputs) and the decode steps (ar, retrieval+pld, graft, one request and a
batch of four, identical to ar). The whole --dry-run (kernel benchmarks in the interpreter,
compiled forwards) takes minutes; it is run by hand."""
from bench import gpu_check


def test_gpu_check_attention_dry_run():
    rows = gpu_check.run_attention(cuda=False)
    assert len(rows) == 1 and rows[0]["splits"] == 2
    assert not rows[0]["agree"].startswith("DIFFER") and rows[0]["triton_ms"] > 0 and rows[0]["sdpa_ms"] > 0
    table = gpu_check.attention_table(rows)
    assert "| toy | 100 | 4 | " in table and "(2)" in table
