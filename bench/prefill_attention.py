"""A/B probe: a prompt's prefill with the fused causal attention against the masked form.

    python -m bench.prefill_attention --model qwen2.5-coder-1.5b --dtype bf16 --tokens 2000

A prefill from slot 0 takes torch's ``scaled_dot_product_attention(is_causal=True)``
(``graft_tk.reference.tree_attention``); the same forward with its plan's keys widened by one
takes the masked form every other plan uses. Random token ids (the cost does not depend on them),
one untimed 64-token prefill first, each form timed once per repeat, in turn.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import graft_tk
from graft_tk.models.attention import AttentionPlan


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    net = graft_tk.load_model(args.model, dtype=args.dtype).net
    n = args.tokens
    net.setup_cache(n + 8)
    ids = torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(0))
    causal = AttentionPlan.causal(0, 1, n, "cpu")
    plans = {"fused causal": causal, "masked form": dataclasses.replace(causal, keys=n + 1)}
    times: dict[str, list[float]] = {name: [] for name in plans}
    with torch.inference_mode():
        net(ids[:, :64], torch.arange(64), 0, logits_at=-1)
        for _ in range(args.repeats):
            for name, plan in plans.items():
                t = time.perf_counter()
                net(ids, torch.arange(n), plan, logits_at=-1)
                times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{args.model} {args.dtype} {n} tokens, {name}: {statistics.median(ts):.1f} s")


if __name__ == "__main__":
    main()
