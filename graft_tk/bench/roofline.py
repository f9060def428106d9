"""How close each forward runs to the machine's limits: time, bytes read, GB/s and FLOP rate.

A decode step is a handful of forward kinds, and on a CPU (or at one row on any device) each is
bound by reading the weights: the floor of a forward is the bytes it reads over the read bandwidth
the machine reaches. ``roofline`` times each kind as graft_tk runs it (eager or compiled) and puts
it beside that floor, the bandwidth measured in the same run:

    ar        the target, 1 row                    (plain decoding; the verify of a chain of 1)
    drafter   the drafter, 1 row and top_k rows    (one expansion depth)
    verify    the target, N rows                   (a tree of the budget)
    prefill   the target, P rows, from slot 0          (a prompt; compute-bound; as decoding runs
              it: eagerly, or compiled in fixed chunks for a quantized model, ``StepForward.prefill``)

Bytes read per forward = every linear layer's stored weight (packed int4 / int8 with its scales and
zeros, or float; a tied LM head reads the embedding table) + the KV cache read at the context
length. FLOPs = 2 x rows x linear weights (attention is small at these contexts). A kind whose
FLOP rate, not its bytes, bounds it shows a low % of bandwidth and a high GFLOP/s.

``graft-bench --roofline`` prints the table (and plots it with ``--plot``);
``python -m graft_tk.bench.roofline --model qwen2.5-coder-1.5b --quant int4 --compile`` runs it alone.
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .._fs import atomic_write_bytes
from ..compiled import Compile, StepForward
from ..cost import forward_ms, median_ms
from ..models.quant import QuantLinear

PROBE_BYTES = 1 << 30      # the bandwidth probe reads 1 GiB: far beyond any cache


@dataclass(frozen=True)
class RooflineRow:
    kind: str            # ar | drafter | verify | prefill
    model: str
    rows: int            # tokens in the forward
    compiled: bool
    ms: float            # median wall time of one forward
    mb_read: float       # weights + KV cache read, MB (1e6 bytes)
    gb_per_s: float      # mb_read / ms
    pct_bandwidth: float  # of the bandwidth measured in the same run
    floor_ms: float      # mb_read at the measured bandwidth
    gflop_per_s: float


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth_gbs(device: torch.device, repeats: int = 5, nbytes: int = PROBE_BYTES) -> float:
    """The read bandwidth a sum over ``nbytes`` of fp32 (1 GiB: beyond any cache) reaches, GB/s,
    the best of ``repeats``: a plain streaming read on every thread, the machine's attainable rate
    and so what a weight-bound forward can hope for. (A bf16 matrix-vector product reads slower
    here, 13-24 GB/s against 30, depending on its shape: a kernel's rate, not the machine's.)"""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def linear_bytes_and_weights(net: nn.Module) -> tuple[int, int]:
    """(bytes stored, weights) of every linear layer of a Transformer, the LM head included (a tied
    head: the embedding table, which it reads whole)."""
    nbytes = weights = 0
    for m in net.modules():
        if isinstance(m, QuantLinear):      # what its kernel reads
            nbytes += sum(t.numel() * t.element_size() for t in (m.qweight, m.packed, m.scales, m.zeros, m.bias) if t is not None)
            weights += m.in_features * m.out_features
        elif isinstance(m, nn.Linear):
            nbytes += m.weight.numel() * m.weight.element_size()
            weights += m.weight.numel()
    if getattr(net, "output", 1) is None:
        e = net.tok_embeddings.weight
        nbytes += e.numel() * e.element_size()
        weights += e.numel()
    return nbytes, weights


def kv_bytes(net, context: int) -> int:
    """Bytes of K and V a forward reads for ``context`` cached tokens (one row of the batch)."""
    c = net.config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * context * net.compute_weight.element_size()


def time_forward(model, rows: int, context: int, repeats: int, compile: bool) -> float:
    """Median ms of one forward of ``rows`` tokens after ``context`` cached ones (random KV: what is
    read costs the same as after a prefill). Clobbers the model's KV cache."""
    net = model.net
    with torch.inference_mode():
        net.setup_cache(context + rows)
        net.kv.normal_(0, 0.5)
    return forward_ms(StepForward(net, compile), model.device, rows, context, repeats)


def time_prefill(model, rows: int, repeats: int, compile: bool) -> float:
    """Median ms of a ``rows``-token prompt's prefill as decoding runs it."""
    net, device = model.net, model.device
    with torch.inference_mode():
        net.setup_cache(rows + 1)
    step = StepForward(net, compile)
    return median_ms(lambda: step.prefill(torch.randint(1000, (1, rows), device=device)), device, repeats)


def measure(target, drafter, *, budget: int, top_k: int, prefill: int = 128, context: int = 256,
            repeats: int = 5, compile: bool | str | Compile = False, bandwidth_gbs: float | None = None,
            progress=None) -> tuple[float, list[RooflineRow]]:
    """(bandwidth GB/s, one row per forward kind). ``compile`` (as ``decode``'s): the step forwards
    compiled (their first call compiles: minutes on a CPU); the prefill as decoding runs it
    (``StepForward.prefill``)."""
    device = target.device
    bw = bandwidth_gbs or read_bandwidth_gbs(device)
    scope = Compile.of(compile)
    on, drafts = scope.target, scope.drafter
    kinds = [("ar", target, 1, on), ("verify", target, budget, on)]
    if drafter is not None and hasattr(drafter, "net"):
        kinds += [("drafter", drafter, 1, drafts), ("drafter", drafter, top_k, drafts)]
    kinds.append(("prefill", target, prefill, on and StepForward(target.net, True).chunked_prefill))
    rows = []
    for kind, model, n, compiled in kinds:
        if progress:
            progress(f"roofline: {kind} {model.name} {n} rows{' (compiling)' if compiled else ''}")
        ms = (time_prefill(model, n, repeats, compiled) if kind == "prefill"
              else time_forward(model, n, context, repeats, compiled))
        wbytes, weights = linear_bytes_and_weights(model.net)
        mb = (wbytes + kv_bytes(model.net, context)) / 1e6
        figures = (ms, mb, mb / ms, 100 * mb / ms / bw, mb / bw, 2 * n * weights / ms / 1e6)
        rows.append(RooflineRow(kind, model.name, n, compiled, *(float(f"{x:.4g}") for x in figures)))
    return bw, rows


def markdown(data: dict) -> str:
    """The table of ``as_json``'s output."""
    bw, rows = data["read_bandwidth_gbs"], [RooflineRow(**r) for r in data["forwards"]]
    out = [f"read bandwidth measured in this run: {bw:.1f} GB/s (a sum over 1 GiB of fp32, best of 5)", "",
           "| forward | model | rows | mode | ms | MB read | GB/s | % of bandwidth | floor ms | GFLOP/s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.kind} | {r.model} | {r.rows} | {'compiled' if r.compiled else 'eager'} | {r.ms:.1f} | "
                   f"{r.mb_read:.0f} | {r.gb_per_s:.1f} | {r.pct_bandwidth:.0f}% | {r.floor_ms:.1f} | {r.gflop_per_s:.0f} |")
    return "\n".join(out)


def as_json(bw: float, rows: list[RooflineRow]) -> dict:
    return {"read_bandwidth_gbs": round(bw, 2), "forwards": [asdict(r) for r in rows]}


def plot(data: dict, path: str | Path, title: str = "") -> None:
    """A roofline of ``as_json``'s output: achieved GFLOP/s against arithmetic intensity (FLOP per
    byte read), one point per forward, under the bandwidth line measured in the same run."""
    bw, rows = data["read_bandwidth_gbs"], [RooflineRow(**r) for r in data["forwards"]]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    intensity = [r.gflop_per_s / r.gb_per_s for r in rows]
    lo, hi = min(intensity) / 2, max(intensity) * 2
    ax.plot([lo, hi], [bw * lo, bw * hi], color="black", linewidth=1, label=f"read bandwidth {bw:.1f} GB/s")
    for i, (r, x) in enumerate(zip(rows, intensity)):
        ax.scatter(x, r.gflop_per_s, s=60, color=f"C{i}", zorder=3,
                   label=f"{r.kind} {r.model} x{r.rows} ({'compiled' if r.compiled else 'eager'}): "
                         f"{r.pct_bandwidth:.0f}% of bandwidth")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOP per byte read")
    ax.set_ylabel("GFLOP/s achieved")
    ax.set_title(title or "Forwards against the memory roofline")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(Path(path), buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    import graft_tk
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b", help="'none' to skip")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--quant", default="none", choices=("none", "int8", "int4", "int4-all"))
    p.add_argument("--drafter-quant", default=None, help="default: int4-all on a CPU, else --quant")
    p.add_argument("--budget", type=int, default=16, help="verify rows N")
    p.add_argument("--top-k", type=int, default=4, help="drafter rows K")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--plot", default=None, metavar="OUT.png")
    args = p.parse_args(argv)
    target = graft_tk.load_model(args.model, dtype=args.dtype, quant=args.quant)
    drafter = None
    if args.drafter != "none":
        dq = args.drafter_quant or ("int4-all" if target.device.type == "cpu" else args.quant)
        drafter = graft_tk.load_model(args.drafter, dtype=args.dtype, quant=dq, device=target.device)
    data = as_json(*measure(target, drafter, budget=args.budget, top_k=args.top_k, compile=args.compile,
                            progress=lambda m: print(m, file=sys.stderr)))
    print(markdown(data))
    if args.plot:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
