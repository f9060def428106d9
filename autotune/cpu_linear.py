"""CPU linear layers as a tunable "kernel": per layer shape and call width, ``native`` or ``blocks``
(``graft_tk.models.cpu_paths``), timed on a layer of that shape with random weights.

``graft-autotune tune --model NAME`` tunes every shape of a model; a bucket reads
``format=bf16,n=17920,k=1536,rows=16``. Imported only when tuning or listing.
"""
from __future__ import annotations

import functools

import torch

from graft_tk.cost import median_ms
from graft_tk.models import cpu_paths
from graft_tk.models.quant import QuantLinear
from graft_tk.models.transformer import Linear

from .tuner import Tunable, parse_bucket

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


def shapes(net: torch.nn.Module) -> list[dict]:
    """Every (format, n, k) with more than one path among a CPU model's linear layers (the tied
    LM head included), at every width of ``cpu_paths.WIDTHS``."""
    found = []
    for m in net.modules():
        if isinstance(m, Linear):
            found.append((cpu_paths.float_format(m.weight.dtype), *m.weight.shape))
        elif isinstance(m, QuantLinear) and m.cpu:
            found.append((m.mode, m.out_features, m.in_features))
    if getattr(net, "output", 0) is None:
        found.append((cpu_paths.float_format(net.tok_embeddings.weight.dtype), *net.tok_embeddings.weight.shape))
    unique = [s for i, s in enumerate(found) if s not in found[:i] and len(cpu_paths.candidates(s[0])) > 1]
    return [dict(format=f, n=n, k=k, rows=r) for f, n, k in unique for r in cpu_paths.WIDTHS]


TUNABLE = Tunable(
    name=cpu_paths.KERNEL,
    kernel=cpu_paths,          # the module's source is hashed: editing a path invalidates its entries
    bucket=cpu_paths.bucket,
    configs=lambda bucket: [{"path": p} for p in cpu_paths.candidates(parse_bucket(bucket)["format"])],
    heuristic=lambda bucket: {"path": cpu_paths.heuristic(parse_bucket(bucket)["format"], parse_bucket(bucket)["rows"])},
    benchmark=benchmark,
    device="cpu",
)
