"""What one forward costs with q new tokens: the cost curve a tree verify rides on.

    python bench/forward_cost.py --model qwen2.5-coder-1.5b --dtype bf16 --q 1,4,16,32 --prefix 200 [--compile]
    python bench/forward_cost.py --drafter none --quant none,int8,int4 --q 1,2,4,8,16

Prints one markdown row per model (the target, and with --drafter its drafter) and prefix: the
median of --repeats forwards of q tokens after a prefix already in the KV cache, in milliseconds.
``--prefix 100,3000`` shows how the cost grows with the context (attention's share); ``--quant`` one row per weight format. A tree
verify of N nodes costs about the q = N forward, so where this curve is flat the budget is nearly
free and where it is steep (a CPU without AVX-512, quantized weights) the best N is small.
``--compile`` times the compiled step forward (``graft_tk.compiled``) instead, after one untimed
call that compiles it (its seconds are printed to stderr).
"""
from __future__ import annotations

import argparse
import sys
import time

import graft_tk
from graft_tk.bench.roofline import time_forward


def forward_ms(model, q: int, prefix: int, repeats: int, compile: bool = False) -> float:
    t = time.perf_counter()
    ms = time_forward(model, q, prefix, repeats, compile)
    if compile:      # the untimed first call compiled the graph
        print(f"{model.name} q={q} prefix={prefix}: compile + timed calls {time.perf_counter() - t:.0f} s",
              file=sys.stderr)
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b", help="also time this model ('none' to skip)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--q", default="1,4,16,32", help="comma list of new-token counts")
    p.add_argument("--prefix", default="200", help="comma list of tokens already in the KV cache")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="time the compiled step forward")
    p.add_argument("--quant", default="none", help="comma list of weight formats: none, int8, int4")
    args = p.parse_args()
    qs = [int(x) for x in args.q.split(",")]
    prefixes = [int(x) for x in args.prefix.split(",")]
    names = [args.model] + ([args.drafter] if args.drafter != "none" else [])
    print(f"| model | dtype | weights | forward | prefix | {' | '.join(f'q={q}' for q in qs)} |")
    print("|---|---|---|---|---|" + "---|" * len(qs))
    for name in names:
        for quant in args.quant.split(","):
            model = graft_tk.load_model(name, dtype=args.dtype, quant=quant, progress=False)
            for prefix in prefixes:
                costs = [forward_ms(model, q, prefix, args.repeats, args.compile) for q in qs]
                kind = "compiled" if args.compile else "eager"
                print(f"| {name} | {args.dtype} | {quant} | {kind} | {prefix} | "
                      f"{' | '.join(f'{c:.0f} ms' for c in costs)} |", flush=True)
            del model


if __name__ == "__main__":
    main()
