"""What exact mode costs a forward: a 1-row decode and an N-node tree verify, with and without it.

    python -m bench.exact_cost --model qwen2.5-coder-1.5b --dtype bf16 --context 300,2000 --nodes 16 [--quant a8w8]

For each context, the median ms of --repeats forwards of each kind after that many cached tokens
(random KV), the two modes alternating call by call so that both see the same machine. Exact mode
is ``graft_tk.models.exact``: linear layers padded to the width from which this CPU's GEMM rows
agree, attention over each query's logical key sequence in fixed blocks. After each context, the
verify's cost in 1-row forwards, in each mode (the flatness speculation lives on).
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

import graft_tk
from graft_tk.models import cpu_paths, exact
from graft_tk.models.attention import AttentionPlan


def random_tree(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of n nodes in depth order: its ancestor-or-self mask [n, n] and depths."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        parent = int(torch.randint(0, i, (1,), generator=gen)) if i else -1
        mask[i] = mask[parent] if parent >= 0 else False
        mask[i, i] = True
    return mask, mask.sum(-1) - 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--context", default="300,2000", help="comma list of cached tokens")
    p.add_argument("--nodes", type=int, default=16, help="N: nodes of the verified tree")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quant", default="none", help="the target's quantization (load_model's quant)")
    args = p.parse_args()
    model = graft_tk.load_model(args.model, dtype=args.dtype, quant=args.quant, progress=False)
    net = model.net
    rows = exact.enable(net)
    exact_rows = {m: m.min_rows for m in net.modules() if hasattr(m, "min_rows")}
    exact_head = net.head_min_rows

    def mode(on: bool):
        for m, r in exact_rows.items():
            m.min_rows = r if on else 1
        net.head_min_rows = exact_head if on else 1
        if not on:
            cpu_paths.apply(net)        # the tuned per-width paths of a plain load
        return partial(exact.attention, min_rows=rows) if on else None

    gen = torch.Generator().manual_seed(0)
    mask, depth = random_tree(args.nodes, gen)
    print(f"{model.name} {args.dtype} ({model.quant}), {torch.get_num_threads()} threads; exact mode pads linear "
          f"calls to {sorted(set(exact_rows.values()) | {exact_head})} rows, attention GEMMs to {rows}")
    print("| context | forward | plain ms | exact ms | exact / plain |")
    print("|---|---|---|---|---|")
    for context in (int(c) for c in args.context.split(",")):
        with torch.inference_mode():
            net.setup_cache(context + args.nodes + 64)
            net.kv.normal_(0, 0.5)
            kinds = {
                "1-row decode": (torch.randint(1000, (1, 1)), torch.tensor([context]), context),
                f"{args.nodes}-node verify": (torch.randint(1000, (1, args.nodes)), context + depth,
                                              AttentionPlan.tree(torch.tensor([context]), mask[None],
                                                                 context + args.nodes)),
            }
            ms = {}
            for kind, (tokens, positions, plan) in kinds.items():
                times = {False: [], True: []}
                for _ in range(args.repeats + 1):           # the first of each: untimed
                    for on in (False, True):
                        attention = mode(on)
                        t = time.perf_counter()
                        net(tokens, positions, plan, attention=attention)
                        times[on].append((time.perf_counter() - t) * 1e3)
                plain, ex = ms[kind] = tuple(statistics.median(times[on][1:]) for on in (False, True))
                print(f"| {context} | {kind} | {plain:.1f} | {ex:.1f} | {ex / plain:.2f}x |", flush=True)
            (p1, e1), (pn, en) = ms.values()
            print(f"| {context} | {args.nodes}-node verify / 1-row decode | {pn / p1:.2f}x | {en / e1:.2f}x | |",
                  flush=True)


if __name__ == "__main__":
    main()
