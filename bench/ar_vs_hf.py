"""Our plain decoding (`ar`) against HF transformers' greedy generate, same weights, dtype and run.

    python bench/ar_vs_hf.py --model smollm2-135m --dtype bf16 --n-prompts 8 --max-new-tokens 64

Prompts alternate between HumanEval and Spec-Bench; the two engines run interleaved prompt by
prompt (fair on a noisy machine) after one warm-up each, and the table reports medians over
prompts plus how many outputs were token-identical.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch

import graft_tk
from graft_tk.bench.anchors import HFAnchors
from graft_tk.decode import encode_prompt
from graft_tk.bench.prompts import load_prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    import transformers

    model = graft_tk.load_model(args.model, dtype=args.dtype)
    hf = HFAnchors(model, None, ("hf_greedy",))  # the same generate call graft-bench's anchor makes
    half = max(1, args.n_prompts // 2)
    prompts = load_prompts("humaneval")[:half] + load_prompts("spec-bench", 1)[: args.n_prompts - half]

    rows = []
    with torch.inference_mode():
        warm = encode_prompt(model, prompts[0].text, chat=True)
        graft_tk.decode(model, warm, max_new_tokens=8)
        hf.run("hf_greedy", warm, 8, 0.0, 0)
        for prompt in prompts:
            ids = encode_prompt(model, prompt.text, chat=True)
            ours = graft_tk.decode(model, ids, max_new_tokens=args.max_new_tokens)
            hf_tokens, hf_stats = hf.run("hf_greedy", ids, args.max_new_tokens, 0.0, 0)
            rows.append({"prompt": prompt.id, "category": prompt.category, "prompt_tokens": len(ids),
                         "ours_tok_s": ours.stats["tokens_per_s"], "hf_tok_s": hf_stats["tokens_per_s"],
                         "identical": ours.tokens == hf_tokens})
            print(f"  {prompt.id:<24} ours {rows[-1]['ours_tok_s']:6.2f} tok/s   hf {rows[-1]['hf_tok_s']:6.2f} tok/s"
                  f"   identical={rows[-1]['identical']}", file=sys.stderr)

    ours_med = statistics.median(r["ours_tok_s"] for r in rows)
    hf_med = statistics.median(r["hf_tok_s"] for r in rows)
    ratio_med = statistics.median(r["ours_tok_s"] / r["hf_tok_s"] for r in rows)
    same = sum(r["identical"] for r in rows)
    print(f"\n| model | dtype | prompts | tokens | ours ar tok/s | HF greedy tok/s | ratio (median per prompt) "
          f"| identical outputs |\n|---|---|---|---|---|---|---|---|\n"
          f"| {model.name} | {args.dtype} | {len(rows)} | {args.max_new_tokens} | {ours_med:.2f} | {hf_med:.2f} "
          f"| {ratio_med:.2f}x | {same}/{len(rows)} |")
    print(f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, graft_tk {graft_tk.__version__}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model.name, "dtype": args.dtype, "rows": rows, "ours_median": ours_med,
                       "hf_median": hf_med, "ratio_median": ratio_med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
