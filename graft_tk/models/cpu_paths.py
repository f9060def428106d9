"""Which way each linear layer multiplies on a CPU, per call width: measured, not assumed.

A linear layer's matmul runs more than one exact way on a CPU (the same weights, float
accumulation), and the fastest depends on the ISA and on the rows of the call (1 for ``ar`` and
the drafter, N for a verify, hundreds in a prefill):

  * ``native``: ``F.linear`` on the layer's own weight (bf16 / fp16 / fp32), torch's packed
    kernels for int8 / int4 (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``);
  * ``blocks``: the weight converted BLOCK_ELEMENTS at a time into a scratch buffer in the format
    this CPU multiplies fastest (bf16 with AVX-512 BF16 / AMX, else fp32), one GEMM per block, an
    int8 layer's scales after, an int4 layer's groups scaled in the conversion. The conversion is a
    fixed cost per call, paid back from some width on: where bf16 is not native torch's bf16 GEMM
    costs the same per row at every width; torch's int4 kernel costs about the same per row from
    16 rows on (a whole prompt read through it is as slow as 16-row calls), a bf16 GEMM ever less.

``graft-autotune tune --model NAME`` times both at each of WIDTHS for every layer shape of a model
and stores the faster in the autotune cache (kernel ``cpu_linear``, keyed by this CPU's model, ISA
flags and threads and by this file's source). A call of r rows takes the pick of the smallest
width >= r (the widest beyond). Without an entry ``heuristic`` decides. fp32 layers have one
path, and so has an int4 layer whose output rows are not whole blocks of 64 (torch's int4
layout). Compiled forwards always run ``native`` (inductor picks its own kernels there).
"""
from __future__ import annotations

import bisect
import functools
import sys
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from .._cpu import cpu_info
from ..autotune import cache
from ..autotune.tuner import source_hash

KERNEL = "cpu_linear"                      # its name in the autotune cache
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)   # call widths measured; a plan holds one path per width
BLOCK_ELEMENTS = 1 << 22                   # weights converted per block (16 MiB in fp32: stays in L3)
_FLOAT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_scratch = threading.local()


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX)."""
    return not cpu_info()[1].isdisjoint({"avx512_bf16", "amx_bf16"})


def candidates(fmt: str, n: int) -> tuple[str, ...]:
    """The paths a layer of weight format ``fmt`` ("bf16", "fp16", "fp32", "int8", "int4", "a8w8")
    and ``n`` output rows can take."""
    if fmt in ("bf16", "fp16", "int8") or (fmt == "int4" and n % INT4_BLOCK == 0 and int4_layout_known()):
        return ("native", "blocks")
    return ("native",)


def heuristic(fmt: str, rows: int) -> str:
    """The path without a tuned entry. int8 from 64 rows and int4 from 256 (calls of 129 rows on)
    on a CPU with native bf16, where torch's packed kernels are compute-bound (int4: the 0.5B
    Qwen's layers 9728 x 896 / 896 x 4864 on a 2-core Zen 4, 15.5 / 7.7 ms native vs 12.7 / 9.3 in
    blocks at 128 rows, 62 / 31 vs 34 / 17 at 512); bf16 / fp16 from 16 rows where bf16 is not
    native (a bf16 Qwen 1.5B forward on a 2-core AVX2 EPYC: 2,365 ms native vs 1,012 ms in
    blocks at 16 rows, 1,240 vs 1,539 ms at 8); else native."""
    if fmt in ("int8", "int4") and native_bf16_cpu():
        return "blocks" if rows >= (64 if fmt == "int8" else 256) else "native"
    if fmt in ("bf16", "fp16") and not native_bf16_cpu():
        return "blocks" if rows >= 16 else "native"
    return "native"


def bucket(format: str, n: int, k: int, rows: int) -> str:
    """The autotune cache's bucket of one layer shape at one width (rows rounded up into WIDTHS)."""
    if format not in ("bf16", "fp16", "fp32", "int8", "int4"):
        raise ValueError(f"format {format!r} is not one of bf16, fp16, fp32, int8, int4")
    if min(int(n), int(k), int(rows)) < 1:
        raise ValueError(f"n, k and rows must be >= 1, got {n}, {k}, {rows}")
    return f"format={format},n={int(n)},k={int(k)},rows={WIDTHS[width_slot(int(rows))]}"


def width_slot(rows: int) -> int:
    """The index in WIDTHS whose pick a call of ``rows`` rows takes."""
    return min(bisect.bisect_left(WIDTHS, rows), len(WIDTHS) - 1)


def key(b: str) -> cache.Key:
    return cache.Key.make(KERNEL, b, source_hash(sys.modules[__name__]), cache.environment())


def plan(fmt: str, n: int, k: int) -> tuple[str, ...]:
    """The path at each of WIDTHS for a layer of this format and shape: tuned entries, else the heuristic."""
    ways = candidates(fmt, n)
    if len(ways) == 1:
        return ("native",) * len(WIDTHS)
    picks = []
    for rows in WIDTHS:
        entry = cache.lookup(key(bucket(fmt, n, k, rows)))
        path = entry.config.get("path") if entry is not None else None
        picks.append(path if path in ways else heuristic(fmt, rows))
    return tuple(picks)


def float_format(dtype: torch.dtype) -> str:
    return _FLOAT[dtype]


def layers(net: torch.nn.Module) -> list[tuple[object, str, str, int, int]]:
    """Every linear layer of ``net`` on a CPU as (holder, attribute its plan goes in, format, n, k):
    a Linear or CPU QuantLinear and its ``paths``, a tied LM head as the net and ``head_paths``."""
    from .quant import QuantLinear
    from .transformer import Linear

    found = []
    for m in net.modules():
        if isinstance(m, Linear) and m.weight.device.type == "cpu":
            found.append((m, "paths", float_format(m.weight.dtype), m.out_features, m.in_features))
        elif isinstance(m, QuantLinear) and m.cpu:
            found.append((m, "paths", m.format, m.out_features, m.in_features))
    head = getattr(net, "tok_embeddings", None)
    if getattr(net, "output", 0) is None and head is not None and head.weight.device.type == "cpu":
        found.append((net, "head_paths", float_format(head.weight.dtype), *head.weight.shape))
    return found


def apply(net: torch.nn.Module) -> None:
    """Give every linear layer of ``net`` on a CPU its plan (``layers``), None where every width is
    ``native``."""
    plans: dict[tuple, tuple[str, ...] | None] = {}
    for holder, attr, fmt, n, k in layers(net):
        if (fmt, n, k) not in plans:
            p = plan(fmt, n, k)
            plans[fmt, n, k] = p if "blocks" in p else None
        setattr(holder, attr, plans[fmt, n, k])


def pick(paths: tuple[str, ...] | None, rows: int) -> str:
    """The path of a call of ``rows`` rows (``native`` without a plan and inside a compiled graph)."""
    if paths is None or torch.compiler.is_compiling():
        return "native"
    return paths[width_slot(rows)]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, paths: tuple[str, ...] | None,
           min_rows: int = 1) -> Tensor:
    """``F.linear`` of a float layer along its plan; a call of fewer than ``min_rows`` rows is
    padded to them (exact mode: ``graft_tk.models.exact``)."""
    rows = x.numel() // x.shape[-1]
    if rows < min_rows:
        y = linear(pad_rows(x.reshape(rows, -1), min_rows), weight, bias, paths)
        return y[:rows].reshape(*x.shape[:-1], weight.shape[0])
    if pick(paths, rows) == "native":
        return F.linear(x, weight, bias)
    y = blocks(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """x [r, K] with zero rows appended up to ``rows``."""
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def _gemm_dtype(x: Tensor) -> torch.dtype:
    """The scratch's dtype: bf16 where it is native and the call is bf16, else fp32."""
    return torch.bfloat16 if native_bf16_cpu() and x.dtype == torch.bfloat16 else torch.float32


def _buffer(dtype: torch.dtype, numel: int) -> Tensor:
    """This thread's scratch, at least ``numel`` elements of ``dtype`` (a fresh 50 MB tensor per
    block would cost several times the copy)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        with torch.inference_mode(False):    # a normal tensor: written in and out of inference mode
            buf = _scratch.buf = torch.empty(max(BLOCK_ELEMENTS, numel), dtype=dtype)
    return buf


def blocks(x: Tensor, weight: Tensor, scales: Tensor | None = None) -> Tensor:
    """``(x @ weight^T) * scales`` in ``x``'s dtype, ``weight`` [N, K] (float or int8) converted
    BLOCK_ELEMENTS at a time into this thread's scratch buffer (bf16 where it is native, else fp32)."""
    dtype = _gemm_dtype(x)
    n, k = weight.shape
    step = max(1, BLOCK_ELEMENTS // k)
    xs = x.to(dtype)
    buf = _buffer(dtype, min(n, step) * k)
    parts = []
    for i in range(0, n, step):
        w = weight[i:i + step]
        y = F.linear(xs, buf[:w.numel()].view(w.shape).copy_(w))
        parts.append(y if scales is None else y * scales[i:i + step].to(dtype))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(x.dtype)


# torch's CPU int4 layout (``_convert_weight_to_int4pack_for_cpu(q, 1)``, uint8 [N, K / 2]): output
# rows in blocks of 64; per block and input column k, 32 bytes whose low nibbles are rows 0-31 of
# the block and high nibbles rows 32-63. ``int4_layout_known`` checks it once against torch.
INT4_BLOCK = 64


def int4_columns(packed: Tensor, k: int, out: Tensor) -> Tensor:
    """``out`` [k, rows] (any float dtype) filled with the 4-bit values of ``packed`` (torch's
    layout, whole blocks of 64 rows) as W^T's columns: out[c, r] = q[r, c]."""
    halves = packed.view(-1, k, INT4_BLOCK // 2).permute(1, 0, 2)           # [k, blocks, 32]
    out_ = out.view(k, halves.shape[1], 2, INT4_BLOCK // 2)
    out_[:, :, 0].copy_(halves & 15)
    out_[:, :, 1].copy_(halves >> 4)
    return out


@functools.lru_cache(maxsize=1)
def int4_layout_known() -> bool:
    """Whether this torch packs int4 as ``int4_columns`` reads it (random values round-tripped)."""
    q = torch.randint(0, 16, (2 * INT4_BLOCK, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    if packed.dtype != torch.uint8 or packed.numel() != q.numel() // 2:
        return False
    return torch.equal(int4_columns(packed, 64, torch.empty(64, 2 * INT4_BLOCK)).T, q.float())


def int4_blocks(x: Tensor, packed: Tensor, scales_zeros: Tensor, group: int) -> Tensor:
    """``x @ W^T`` in ``x``'s dtype for an int4 layer in torch's CPU layout (``packed`` [N, K / 2],
    ``scales_zeros`` [K / group, N, 2]: W = (q - 8) * scale + zero), W^T rebuilt a block of output
    rows at a time in this thread's scratch (q * scale + (zero - 8 * scale): one rounding) and
    multiplied there."""
    dtype = _gemm_dtype(x)
    k = x.shape[-1]
    n = packed.shape[0]
    step = max(INT4_BLOCK, BLOCK_ELEMENTS // k // INT4_BLOCK * INT4_BLOCK)
    xs = x.to(dtype)
    buf = _buffer(dtype, min(n, step) * k)
    parts = []
    for i in range(0, n, step):
        sz = scales_zeros[:, i:i + step].float()
        rows = sz.shape[1]
        w_t = int4_columns(packed[i:i + rows], k, buf[:k * rows].view(k, rows))
        groups = w_t.view(k // group, group, rows)
        scale, zero = sz[:, None, :, 0], sz[:, None, :, 1]
        torch.addcmul((zero - 8 * scale).to(dtype), groups, scale.to(dtype), out=groups)
        parts.append(xs @ w_t)
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(x.dtype)
