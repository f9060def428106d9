"""One forward of q tokens with each linear layer on its CPU plan against all-native, in one process.

    python bench/cpu_paths_ab.py --model qwen2.5-coder-1.5b --dtype bf16 --q 1,4,8,16,64 --prefix 200
    python bench/cpu_paths_ab.py --model qwen2.5-coder-0.5b --quant int4-all --q 128,260,512 --prefill

The plan is what ``load_model`` gave the layers (``graft_tk.models.cpu_paths``: the autotune
cache's picks, else the heuristic); "native" clears it. Both are timed at each q in turn (median
of --repeats forwards after a prefix of --prefix tokens in the KV cache), so drift in the machine
hits both alike. With --prefill, a prompt of q tokens read as decoding reads it (the LM head at
its last position only; a drafter's window read is one of 4 + 256). Prints one markdown row per q.
"""
from __future__ import annotations

import argparse

import graft_tk
from graft_tk.bench.roofline import time_forward, time_prefill
from graft_tk.models import cpu_paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--quant", default="none")
    p.add_argument("--q", default="1,4,8,16,64", help="comma list of new tokens per forward")
    p.add_argument("--prefix", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill", action="store_true", help="time a prompt's read of q tokens (no --prefix)")
    args = p.parse_args()
    model = graft_tk.load_model(args.model, dtype=args.dtype, device="cpu", quant=args.quant, progress=False)
    layers = cpu_paths.layers(model.net)
    plans = [getattr(holder, attr) for holder, attr, *_ in layers]
    print(f"{sum(p is not None for p in plans)} of {len(layers)} CPU linear layers have a plan")
    print("| q | planned ms | native ms | native / planned |\n|---|---|---|---|")
    for q in [int(x) for x in args.q.split(",")]:
        ms = {}
        for name, paths in (("planned", plans), ("native", [None] * len(layers))):
            for (holder, attr, *_), p in zip(layers, paths):
                setattr(holder, attr, p)
            ms[name] = (time_prefill(model, q, args.repeats, False) if args.prefill
                        else time_forward(model, q, args.prefix, args.repeats, False))
        print(f"| {q} | {ms['planned']:.0f} | {ms['native']:.0f} | {ms['native'] / ms['planned']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
