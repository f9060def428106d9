"""CPU linear layers as a tunable "kernel": per layer shape and call width, ``native`` or ``blocks``
(``graft_tk.models.cpu_paths``); a bucket reads ``format=bf16,n=17920,k=1536,rows=16``.

Two timers. ``tune_model`` (``graft-autotune tune --model NAME``) times the model's whole forward
at each width with every layer native, then with every layer in blocks, and writes the faster for
each of its layer shapes at that width: what a verify or a prefill will see, weights streamed from
memory layer after layer. ``benchmark`` (``--shapes``) times one layer alone with random weights;
near the crossover it overstates blocks (measured on an AVX2 EPYC: blocks won per layer at 8
rows and lost by 15-20% in the whole forward). Imported only when tuning or listing.
"""
from __future__ import annotations

import functools

import torch

from graft_tk.cost import forward_ms, median_ms
from graft_tk.models import cpu_paths
from graft_tk.models.quant import QuantLinear
from graft_tk.models.transformer import Linear

from . import cache
from .tuner import Tunable, key_for, parse_bucket

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REPEATS = 5


@functools.lru_cache(maxsize=2)
def _layer(fmt: str, n: int, k: int) -> torch.nn.Module:
    """A CPU layer of this format and shape with random weights (timing does not depend on them)."""
    w = torch.randn(n, k) / k ** 0.5
    if fmt in DTYPES:
        layer = Linear(k, n, bias=False, dtype=DTYPES[fmt])
        layer.weight.data.copy_(w)
        return layer.requires_grad_(False)
    return QuantLinear.from_float(w, None, fmt, torch.bfloat16)


def benchmark(bucket: str, config: dict) -> float:
    """Median ms of one call of the bucket's width along ``config["path"]``."""
    b = parse_bucket(bucket)
    layer = _layer(b["format"], b["n"], b["k"])
    dtype = layer.weight.dtype if isinstance(layer, Linear) else layer.scales.dtype
    layer.paths = (config["path"],) * len(cpu_paths.WIDTHS)
    x = torch.randn(b["rows"], b["k"], dtype=dtype)
    with torch.inference_mode():
        return median_ms(lambda: layer(x), torch.device("cpu"), REPEATS)


def shapes_of(net: torch.nn.Module) -> list[dict]:
    """Every (format, n, k) with more than one path among a CPU model's linear layers (the tied
    LM head included), at every width of ``cpu_paths.WIDTHS``."""
    unique = dict.fromkeys((fmt, n, k) for _, _, fmt, n, k in cpu_paths.layers(net)
                           if len(cpu_paths.candidates(fmt, n)) > 1)
    return [dict(format=f, n=n, k=k, rows=r) for f, n, k in unique for r in cpu_paths.WIDTHS]


def tune_model(model, path=None, *, prefix: int = 200, repeats: int = 3, progress=None) -> list[cache.Entry]:
    """Per width of ``cpu_paths.WIDTHS``, widest first: ``model``'s forward of that many tokens
    after ``prefix`` cached ones, every multi-path layer native, then in blocks (median of
    ``repeats``); the faster becomes the entry of each of those layers' shapes at that width.
    Returns the entries written.
    ``progress(width, {path: ms})`` is called after each width. Clobbers the KV cache."""
    net = model.net
    tuned = [(holder, attr) for holder, attr, fmt, n, _ in cpu_paths.layers(net) if len(cpu_paths.candidates(fmt, n)) > 1]
    shapes = sorted({(s["format"], s["n"], s["k"]) for s in shapes_of(net)})
    saved = [getattr(holder, attr) for holder, attr in tuned]
    with torch.inference_mode():
        net.setup_cache(prefix + cpu_paths.WIDTHS[-1])
        net.kv.normal_(0, 0.5)
    entries = []
    try:
        # widest first: a verify runs after a prefill's wide calls, and a narrow call's fp32 GEMM
        # was measured slower after wider ones (8 rows in blocks: 860 ms, 1527 ms after 16 rows)
        for width in reversed(cpu_paths.WIDTHS):
            ms = {}
            for way in ("native", "blocks"):
                for holder, attr in tuned:
                    setattr(holder, attr, (way,) * len(cpu_paths.WIDTHS))
                ms[way] = forward_ms(net, model.device, width, prefix, repeats)
            best = min(ms, key=ms.get)
            for fmt, n, k in shapes:
                entries.append(cache.Entry(key=key_for(TUNABLE, cpu_paths.bucket(fmt, n, k, width)),
                                           config={"path": best}, time_ms=ms[best],
                                           heuristic_ms=ms[cpu_paths.heuristic(fmt, width)], tuned_at=cache.now()))
            if progress is not None:
                progress(width, ms)
    finally:
        for (holder, attr), paths in zip(tuned, saved):
            setattr(holder, attr, paths)
    cache.update(entries, path)
    return entries


TUNABLE = Tunable(
    name=cpu_paths.KERNEL,
    kernel=cpu_paths,          # the module's source is hashed: editing a path invalidates its entries
    bucket=cpu_paths.bucket,
    configs=lambda bucket: [{"path": p} for p in cpu_paths.candidates(parse_bucket(bucket)["format"], parse_bucket(bucket)["n"])],
    heuristic=lambda bucket: {"path": cpu_paths.heuristic(parse_bucket(bucket)["format"], parse_bucket(bucket)["rows"])},
    benchmark=benchmark,
    device="cpu",
)
