"""Tree attention as a tunable kernel: candidate tiles, the representative input of a bucket, the timer.

The launcher (``graft_tk.kernels.tree_attention``) asks ``select`` for its bucket; this module is
imported only when tuning or listing (``graft-autotune``), never on the CPU path.
"""
from __future__ import annotations

import math

import torch

from graft_tk.kernels._common import multiprocessors
from graft_tk.kernels.tree_attention import (MIN_KEYS_PER_SPLIT, _launch, _tree_attention_kernel, block_sizes,
                                             kv_splits, shape_bucket)

from .tuner import Tunable, parse_bucket

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
KV_HEADS = 4   # representative input: 4 kv heads x B = 1, as in 1.5B-8B models (2-8 kv heads)


def bucket(rows: int, head_dim: int, kv_len: int, dtype: str = "bfloat16") -> str:
    """Shape keywords (``--shapes rows=54,head_dim=128,kv_len=1000``) -> the cache's bucket."""
    if str(dtype).removeprefix("torch.") not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return shape_bucket(int(rows), int(head_dim), int(kv_len), str(dtype).removeprefix("torch."))


# Shared memory per block of the smallest GPU the kernels are built for (sm_80, A100: 163 KB). A
# GPU with less (sm_86 / sm_89: 99 KB) skips the larger candidates when tuning (they fail to launch).
SHARED_BYTES_MAX = 166_912


def shared_bytes(block_m: int, block_n: int, head_dim: int, num_stages: int, dtype: str) -> int:
    """Shared memory (bytes) a tile config compiles to on sm_80, fitted to what triton 3.9 reports
    (exact to 512 B at the nine tiles probed, ``bench/compile_check.py``). fp32, whose ``ieee`` dots
    run on FMA units: K and V tiles in num_stages - 1 buffers, the Q tile and the P tile, 4 bytes
    each (64 x 128 tiles at d 64, 3 stages: 180,480 B). fp16 / bf16 on tensor cores: one K and one
    V tile whatever the stages, the Q tile, a byte per P element (128 x 128 at d 128: 114,688 B)."""
    if dtype == "float32":
        return 4 * ((num_stages - 1) * 2 * block_n * head_dim + block_m * head_dim + block_m * block_n)
    e = DTYPES[dtype].itemsize
    return e * (2 * block_n * head_dim + block_m * head_dim) + block_m * block_n


def configs(bucket: str) -> list[dict]:
    """BLOCK_M up to the bucket's rows (larger tiles would be padding), BLOCK_N 32-128, 4 or 8 warps,
    2 or 3 stages, without the tiles whose shared memory passes sm_80's (``shared_bytes``: only
    fp32 ones, from 64 x 128 at head dim 64 and 64 x 64 at 128): at bf16 / fp16, 12 tiles at rows
    16, 36 at 64, 48 from 128; each with the keys in 1, 4 or 16 splits where every split keeps
    >= MIN_KEYS_PER_SPLIT keys (1 and 4 at kv_len 1024, all three from 4096). At head dim 256 BLOCK_M x BLOCK_N stays <= 64 x 64 as well (registers)."""
    b = parse_bucket(bucket)
    splits = [s for s in (1, 4, 16) if s == 1 or b["kv_len"] // s >= MIN_KEYS_PER_SPLIT]
    out = []
    for block_m in (16, 32, 64, 128):
        if block_m > max(b["rows"], 16):
            continue
        for block_n in (32, 64, 128):
            if b["head_dim"] >= 256 and block_m * block_n > 64 * 64:
                continue
            for num_warps in (4, 8):
                for num_stages in (2, 3):
                    # 1 KB kept for the compiler's scratch (fp32's estimate runs up to 512 B under)
                    if shared_bytes(block_m, block_n, b["head_dim"], num_stages, b["dtype"]) > SHARED_BYTES_MAX - 1024:
                        continue
                    for kv_splits in splits:
                        out.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
                                        num_stages=num_stages, KV_SPLITS=kv_splits))
    return out


def heuristic(bucket: str, device: torch.device | str = "cuda") -> dict:
    """What the launcher runs untuned on the bucket's input: ``block_sizes`` and ``kv_splits`` for its
    programs on this device's SMs (1 split off a GPU)."""
    b = parse_bucket(bucket)
    meta = block_sizes(b["rows"], b["head_dim"], b["dtype"])
    programs = math.ceil(b["rows"] / meta["BLOCK_M"]) * KV_HEADS
    sms = multiprocessors(torch.device(device)) if torch.cuda.is_available() else 0
    return {**meta, "KV_SPLITS": kv_splits(programs, b["kv_len"], sms)}


def inputs(bucket: str, device: torch.device | str = "cuda") -> tuple:
    """(q, k, v, prefix, block, keys, scale) of the bucket's largest shape: T = min(rows, 64) tree
    nodes in a causal (chain) block, the rest of the rows as the GQA group, keys filling the bucket."""
    b = parse_bucket(bucket)
    rows, d, kv_len, dtype = b["rows"], b["head_dim"], b["kv_len"], DTYPES[b["dtype"]]
    t = min(rows, 64)
    group = rows // t
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, KV_HEADS * group, t, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(1, KV_HEADS, kv_len, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(1, KV_HEADS, kv_len, d, generator=g).to(device=device, dtype=dtype)
    block = torch.ones(1, t, t, dtype=torch.bool, device=device).tril()
    prefix = torch.tensor([kv_len - t], device=device)
    return q, k, v, prefix, block, kv_len, 1.0 / math.sqrt(d)


def benchmark(bucket: str, config: dict) -> float:
    """Milliseconds per launch on the current GPU (triton.testing.do_bench: median after warm-up)."""
    import triton.testing
    q, k, v, prefix, block, keys, scale = inputs(bucket)
    out = torch.empty_like(q)
    return triton.testing.do_bench(lambda: _launch(q, k, v, prefix, block, keys, scale, out, config),
                                   warmup=10, rep=40)


TUNABLE = Tunable(
    name="tree_attention", kernel=_tree_attention_kernel, bucket=bucket, configs=configs, heuristic=heuristic,
    benchmark=benchmark,
    # decode / tree verify (16 and 64 rows) at head dims 64 and 128, short to long contexts, bf16: 12 buckets
    shapes=tuple(dict(rows=r, head_dim=d, kv_len=n, dtype="bfloat16")
                 for r in (16, 64) for d in (64, 128) for n in (1024, 4096, 16384)),
)
