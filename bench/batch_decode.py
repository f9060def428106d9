"""Methods decoding the same prompts B at a time in one batch (continuous batching, no server),
interleaved in one run: what a batch's step policy makes of speculation at that size.

    python -m bench.batch_decode --model qwen2.5-coder-1.5b --dtype bf16 --batch 4 --methods ar,graft \\
        --prompts "mt-bench#4,humaneval#4" --max-new-tokens 64 --rounds 2 [--json OUT]

Each round runs every method once on all the prompts (``graft_tk.batch.decode_batch``, a fresh
engine each time, so nothing learnt carries over), with the step costs graft-serve measures at
its start. Per method: the median tokens/s over the rounds, its ratio to the first method's, and
of the steps the first prompt took part in, how many verified its root alone (plain decoding),
how many speculated and how many ran the drafter.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

import torch

import graft_tk
from graft_tk.batch import decode_batch
from graft_tk.bench.prompts import load_prompts
from graft_tk.calibration.cost import measure_step_cost
from graft_tk.cli._models import default_drafter, load_drafter
from graft_tk.config import GraftConfig
from graft_tk.decode import encode_prompt
from graft_tk.engine import Engine
from graft_tk.methods import METHODS
from graft_tk.models.quant import cpu_drafter_quant


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--drafter", default=None, help="default: the model's registered drafter (or self:L)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--batch", type=int, default=4, help="requests decoding together (default 4)")
    p.add_argument("--methods", default="ar,graft", help="comma list; the first is the baseline")
    p.add_argument("--prompts", default="mt-bench#4,humaneval#4", help="prompt sets, as graft-bench takes them")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or args.batch < 1 or args.rounds < 1:
        p.error(f"unknown methods {unknown} (known: {', '.join(METHODS)})" if unknown
                else "--batch and --rounds must be >= 1")
    target = graft_tk.load_model(args.model, dtype=args.dtype)
    drafter = None
    if any(METHODS[m].drafts for m in methods):
        quant = cpu_drafter_quant(target.device, target.dtype) or "none"
        drafter = load_drafter(args.drafter or default_drafter(args.model), target, args.model, dtype=args.dtype,
                               quant=quant)
    config = GraftConfig(cost=measure_step_cost(target, drafter, GraftConfig()))
    prompts = [encode_prompt(target, q.text, chat=True) for q in load_prompts(args.prompts)]
    rates: dict[str, list[float]] = {m: [] for m in methods}
    steps: dict[str, dict[str, int]] = {}
    for r in range(args.rounds):
        for m in methods:
            batch = Engine(target, drafter if METHODS[m].drafts else None, config).batch(args.batch)
            t = time.perf_counter()
            with torch.inference_mode():
                out = decode_batch(batch, prompts, m, args.max_new_tokens)
            seconds = time.perf_counter() - t
            tokens = sum(len(o) for o, _ in out)
            rates[m].append(tokens / seconds)
            per_step = out[0][1]["per_step"]
            nodes = collections.Counter(per_step["nodes"])
            steps[m] = {"plain": nodes[1], "speculating": sum(nodes.values()) - nodes[1],
                        "drafting": sum(1 for f in per_step["drafter_forwards"] if f)}
            print(f"round {r} {m}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.2f} tok/s", file=sys.stderr)
    base = statistics.median(rates[methods[0]])
    print(f"| method | tok/s (median of {args.rounds}) | vs {methods[0]} | prompt 0's steps: plain / speculating / drafting |")
    print("|---|---|---|---|")
    rows = []
    for m in methods:
        med = statistics.median(rates[m])
        s = steps[m]
        print(f"| {m} | {med:.2f} | {med / base:.2f}x | {s['plain']} / {s['speculating']} / {s['drafting']} |")
        rows.append({"method": m, "tokens_per_s": rates[m], "median": med, "vs_first": med / base, "steps": s})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu": _cpu(), "rows": rows}, f, indent=1)
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
