"""What the adaptive engine chooses step by step when the workload changes halfway.

    python bench/adaptive_trace.py --model qwen2.5-coder-1.5b --first humaneval#6 --then math \\
        --max-new-tokens 64 --out adaptive_trace.png [--profile]

One ``Engine`` with the device's cost model (the profile's with ``--profile``, else measured
first) decodes the ``--first`` prompts, then the ``--then`` prompts, as a server would see them;
the picture shows the tree nodes verified, the drafter forwards and the tokens committed per
step, shaded by workload. ``--json`` keeps the numbers. Not a test: it only shows the choices.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import graft_tk
from graft_tk.cli._models import default_drafter, load_drafter
from graft_tk.config import GraftConfig
from graft_tk.calibration.cost import measure_step_cost
from graft_tk.engine import Engine
from graft_tk.bench.plots import plot_trace
from graft_tk.bench.prompts import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--drafter", default=None, help="default: the registry's pair; self:L; none")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--method", default="graft")
    p.add_argument("--first", default="humaneval#6")
    p.add_argument("--then", default="math")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="the cost model of this pair's graft-calibrate profile")
    p.add_argument("--out", default="adaptive_trace.png")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    target = graft_tk.load_model(args.model, dtype=args.dtype, progress=False)
    spec = args.drafter or default_drafter(args.model)
    drafter = load_drafter(spec, target, args.model, dtype=args.dtype)
    config = GraftConfig()
    if args.profile:
        from graft_tk.profiles import find_profile
        profile = find_profile(target, drafter)
        if profile is None or profile.config.cost is None:
            sys.exit("no profile with a cost model for this pair: run graft-calibrate --cost-only first")
        config = profile.config
    else:
        print("measuring the cost model ...", file=sys.stderr)
        config = dataclasses.replace(config, cost=measure_step_cost(
            target, drafter, config, progress=lambda m: print("  " + m, file=sys.stderr)))
    engine = Engine(target, drafter, config)
    per_step: dict[str, list[int]] = {"nodes": [], "drafter_forwards": [], "committed": []}
    labels, runs = [], []
    for source in (args.first, args.then):
        for prompt in load_prompts(source):
            r = graft_tk.decode(target, prompt.text, drafter=drafter, method=args.method, engine=engine,
                                max_new_tokens=args.max_new_tokens)
            for key in per_step:
                per_step[key] += r.stats["per_step"][key]
            labels += [prompt.category] * r.stats["steps"]
            runs.append({"prompt": prompt.id, "category": prompt.category, "tokens_per_s": r.stats["tokens_per_s"],
                         "mat": r.stats["mat"], "steps": r.stats["steps"]})
            print(f"{prompt.id}: {r.stats['tokens_per_s']:.2f} tok/s, MAT {r.stats['mat']:.2f}, "
                  f"nodes/step {sum(r.stats['per_step']['nodes']) / max(r.stats['steps'], 1):.1f}, "
                  f"drafter forwards/step {r.stats['drafter_forwards_per_step']:.2f}", file=sys.stderr)
    title = (f"{target.name} + {drafter.name if drafter else 'no drafter'}, {args.dtype}, {args.method} adaptive: "
             f"{args.first} then {args.then}, {args.max_new_tokens} tokens each")
    plot_trace(per_step, labels, args.out, title)
    print(f"picture: {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": dataclasses.asdict(config), "runs": runs, "per_step": per_step, "labels": labels}, f)


if __name__ == "__main__":
    main()
