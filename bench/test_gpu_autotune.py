"""GPU-only: real tuning of the tree-attention tiles, then the launcher uses them.

Run by bench/gpu_check.py on a CUDA machine (outside the CPU test suite: without a GPU there is
nothing to time; the tuning logic itself is tested on CPU in tests/test_autotune.py).
"""
import pytest
import torch

from graft_tk.autotune import select, tuner
from graft_tk.autotune import tree_attention as ta_tunable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU check: needs CUDA")


def test_gpu_tune_then_the_launcher_uses_the_tuned_config(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_TK_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    bucket = "rows=16,head_dim=64,kv_len=1024,dtype=bfloat16"
    entry = tuner.tune(ta_tunable.TUNABLE, bucket)
    assert entry.config in ta_tunable.configs(bucket) + [ta_tunable.heuristic(bucket)]
    assert entry.time_ms > 0 and entry.heuristic_ms > 0
    assert select("tree_attention", bucket, {"unused": 0}, torch.device("cuda")) == entry.config
