"""Plain decoding (``ar``) of one model in each weight format, interleaved in one run.

    python bench/quant_decode.py --model qwen2.5-coder-1.5b --quants none,int8,int4 --prompts "humaneval#4" \\
        --max-new-tokens 32 [--json OUT]

For each format (bf16 activations): the checkpoint folder's size on disk, the weights read per
token, and per prompt (formats run one after the other on each prompt, so drift in the machine's
speed hits all of them alike) tokens/s over the whole call and after the prefill, and how many of
the first tokens agree with the first format's output. The summary row gives medians, the speedup
over the first format, and the fraction of this machine's read bandwidth (a timed sum over a
2 GiB tensor, both cores) that the after-prefill rate reaches: weights read per token x tokens/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import graft_tk
from graft_tk.decode import encode_prompt
from graft_tk.bench.prompts import load_prompts


def read_bandwidth_gbs(gib: float = 2.0, repeats: int = 5) -> float:
    """This machine's memory read rate: the median of timed sums over a ``gib`` GiB fp32 tensor."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one forward reads: every parameter and buffer but the embedding table (one
    row per token), which counts when it is also the LM head."""
    net = model.net
    total = sum(t.numel() * t.element_size() for t in [*net.parameters(), *net.buffers()])
    embedding = net.tok_embeddings.weight
    return total - (embedding.numel() * embedding.element_size() if net.output is not None else 0)


def folder_bytes(model) -> int:
    return sum(f.stat().st_size for f in model.path.iterdir() if f.is_file())


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens equal the reference's."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--quants", default="none,int8,int4", help="comma list; the first is the reference")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--prompts", default="humaneval#4")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", default=None, help="write every run here")
    args = p.parse_args()
    quants = args.quants.split(",")
    models = {}
    for quant in quants:
        t = time.perf_counter()
        models[quant] = graft_tk.load_model(args.model, dtype=args.dtype, quant=quant)
        print(f"loaded {quant} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    bandwidth = read_bandwidth_gbs()
    prompts = load_prompts(args.prompts)
    runs = []
    for prompt in prompts:
        reference = None
        for quant in quants:
            model = models[quant]
            r = graft_tk.decode(model, encode_prompt(model, prompt.text, chat=True), max_new_tokens=args.max_new_tokens)
            s = r.stats
            reference = r.tokens if reference is None else reference
            after = (s["tokens"] - 1) / max(s["seconds"] - s["prefill_seconds"], 1e-9)
            runs.append({"prompt": prompt.id, "quant": quant, "tokens": s["tokens"], "tokens_per_s": s["tokens_per_s"],
                         "after_prefill_tokens_per_s": after, "agree": agreement(r.tokens, reference)})
            print(f"{prompt.id} {quant}: {s['tokens_per_s']:.2f} tok/s, {after:.2f} after the prefill, "
                  f"{runs[-1]['agree']}/{s['tokens']} agree", file=sys.stderr, flush=True)

    print(f"\n{args.model}, {args.dtype} activations, {len(prompts)} prompts ({args.prompts}), "
          f"{args.max_new_tokens} new tokens; read bandwidth here {bandwidth:.1f} GB/s\n")
    print("| weights | folder on disk | weights read per token | tok/s | after prefill | speedup vs "
          f"{quants[0]} (after prefill) | of read bandwidth | tokens agreeing with {quants[0]} | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for quant in quants:
        mine = [r for r in runs if r["quant"] == quant]
        tps = statistics.median(r["tokens_per_s"] for r in mine)
        after = statistics.median(r["after_prefill_tokens_per_s"] for r in mine)
        per_token = weight_bytes_per_token(models[quant])
        summary[quant] = {"tokens_per_s": tps, "after_prefill_tokens_per_s": after,
                          "folder_bytes": folder_bytes(models[quant]), "weight_bytes_per_token": per_token,
                          "bandwidth_fraction": per_token * after / (bandwidth * 1e9),
                          "agree": sum(r["agree"] for r in mine), "tokens": sum(r["tokens"] for r in mine),
                          "identical": sum(r["agree"] == r["tokens"] for r in mine)}
    base = summary[quants[0]]
    for quant, s in summary.items():
        print(f"| {quant} | {s['folder_bytes'] / 2**20:,.0f} MiB | {s['weight_bytes_per_token'] / 2**20:,.0f} MiB | "
              f"{s['tokens_per_s']:.2f} | {s['after_prefill_tokens_per_s']:.2f} | "
              f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}x ({s['after_prefill_tokens_per_s'] / base['after_prefill_tokens_per_s']:.2f}x) | "
              f"{s['bandwidth_fraction']:.0%} | {s['agree']}/{s['tokens']} | {s['identical']}/{len(prompts)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bandwidth_gbs": bandwidth, "runs": runs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
