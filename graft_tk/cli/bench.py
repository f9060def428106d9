"""graft-bench: every decoding method side by side on the same prompts, machine and run.

    graft-bench --model qwen2.5-coder-1.5b --methods ar,tree,pruned,retrieval,graft \\
                --prompts spec-bench --n-per-category 2 --max-new-tokens 64 --json out.json --plot out.png

Methods run interleaved prompt by prompt after one untimed warm-up each (a compiled one decodes
the whole first prompt, building every graph); every run starts from a
fresh engine (cold adjacency matrix), so no method inherits another's state. Reports medians of
tokens/s and speedup over ``ar``, MAT, drafter forwards per step, accepted tokens by source, the
time split, and whether each greedy output equals ``ar``'s. With transformers installed, HF
greedy, HF assisted generation (same drafter) and HF prompt lookup run in the same loop; with
llama-cpp-python, llama.cpp's plain decoding and prompt lookup on the same GGUF file.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

from ..bench import compare as bench
from ..compiled import Compile
from ..bench.anchors import ANCHOR_NAMES, LLAMA_CPP_ANCHORS, make_anchors, parse_anchors
from ..bench.prompts import load_prompts
from ..config import GraftConfig
from ..decode import encode_prompt
from ..errors import GraftError, InputError
from ..methods import METHODS
from ..models import load_model
from ..sampling import check_sampling_args
from ._models import add_quant_args, at_least, drafter_quant, drafter_spec, gguf_source, load_drafter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graft-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b",
                   help="target: built-in name, checkpoint folder, .gguf file or cached HF repo id "
                        "(default: %(default)s)")
    p.add_argument("--eagle3", default=None, metavar="PATH",
                   help="draft with this EAGLE-3 head folder (graft-train-eagle3 --out, or a published one)")
    p.add_argument("--drafter", default=None,
                   help="drafter: a model name or path, self:L (the target's first L layers) or none "
                        "(default: the registry's pair for --model, e.g. qwen2.5-coder-0.5b)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma list of methods; ar always runs as the baseline (default: %(default)s)")
    p.add_argument("--prompts", default="humaneval",
                   help="humaneval | spec-bench | spec-bench:PATH | mt-bench | math | mix | long | PATH.jsonl, or "
                        "a comma list, each optionally SOURCE#K (its first K prompts per category; mt-bench#K: K "
                        "prompts round-robin over MT-bench's 8 categories); mix = humaneval#6,spec-bench#1,math; "
                        "long = code editing, documents and conversations at 1k-8k tokens of context, each with "
                        "its own answer length (long@2k+4k: some sizes) (default: %(default)s)")
    p.add_argument("--n-per-category", type=at_least(1), default=None,
                   help="keep the first K prompts of each category (default: all)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=None,
                   help=f"new tokens per prompt (default: its task's, e.g. the long set's, else {bench.DEFAULT_NEW_TOKENS})")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default bf16; fp32 to judge exactness)")
    add_quant_args(p)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; exactness is checked)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus cut when sampling (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, the same for every method")
    p.add_argument("--repeats", type=at_least(1), default=1, help="timed runs per (prompt, method); the median is kept")
    p.add_argument("--profile", action="store_true",
                   help="start from the graft-calibrate profile of this model pair, device and dtype "
                        "(default: GraftConfig's defaults); --budget/--tau/... still override")
    p.add_argument("--budget", type=int, default=None, help="N: tree nodes verified per step (GraftConfig)")
    p.add_argument("--tau", type=float, default=None, help="pruning threshold on drafter path probability")
    p.add_argument("--top-k", type=int, default=None, help="K: children per drafted node")
    p.add_argument("--max-depth", type=int, default=None, help="D: drafter expansions per step at most")
    p.add_argument("--anchors", nargs="?", const="all", default=None, metavar="LIST",
                   help=f"run anchors: all, or a comma list of {', '.join(ANCHOR_NAMES)} (default: those whose "
                        "package, transformers or llama-cpp-python, is installed)")
    p.add_argument("--no-anchors", dest="anchors", action="store_const", const="none", help="skip the anchors")
    p.add_argument("--json", default=None, metavar="OUT", help="write the full report (JSON) here")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write tokens/s-vs-MAT and speedup plots here")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=bench.BENCH_COMPILE_MODES,
                   help="run the step forwards compiled (torch.compile; minutes per model on a small CPU, in "
                        "the untimed warm-up); 'drafter': only the drafter model's; 'both' runs every method "
                        "eager and as '<method>:compiled' in one interleaved run")
    p.add_argument("--exact", action="store_true",
                   help="every run (ar too) with the target's forwards row-invariant: each method's output equals "
                        "ar's in bf16 too (CPU, eager; graft_tk.models.exact); a run without it is the baseline")
    p.add_argument("--adaptive", nargs="?", const="on", default="off", choices=bench.ADAPTIVE_MODES,
                   help="the methods that prune choose drafting depth and budget per step from the device's cost "
                        "model (--profile's, else measured first, a minute or two); 'both' runs each such method "
                        "fixed and as '<method>:adaptive' in one interleaved run")
    p.add_argument("--config", action="append", default=[], metavar="NAME=PROFILE.json",
                   help="also run each method as '<method>@NAME' with this graft-calibrate profile's config as it "
                        "is (e.g. one tuned on another workload); repeatable")
    p.add_argument("--roofline", action="store_true",
                   help="also time each forward kind (ar 1 row, drafter 1 and K rows, verify N rows, prefill) against "
                        "the read bandwidth measured in the same run: ms, MB read, GB/s, %% of bandwidth, GFLOP/s "
                        "(graft_tk.bench.roofline; with --plot also OUT-roofline.png)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        report = _run(args)
    except GraftError as e:
        print(f"graft-bench: error: {e}", file=sys.stderr)
        return 2
    print(bench.markdown_table(report["summary"], args.temperature))
    if report.get("roofline"):
        from ..bench import roofline
        print("\nroofline:\n" + roofline.markdown(report["roofline"]))
    if any(e.get("expected_accepted_per_step") for e in report["summary"]["all"].values()):
        print("\nacceptance estimates vs observed (all prompts):\n" + bench.acceptance_table(report["summary"]))
    for name, s in report["anchors"].items():
        if s["status"] != "ok":
            print(f"\nnote: anchor {name} {s['status']}: {s['error']}", file=sys.stderr)
    if report["config"]["dtype"] != "float32" and args.temperature == 0 and _mismatches(report["summary"]):
        print("\nnote: in bf16/fp16 a batched verification can flip a near-tie, so outputs may drift from ar's; "
              "judge exactness with --dtype fp32", file=sys.stderr)
    m = report["machine"]
    quant = "" if report["config"]["quant"] == "none" else f" ({report['config']['quant']})"
    print(f"\n{report['config']['target']} + {report['config']['drafter']}, {report['config']['dtype']}{quant}, "
          f"{len(report['prompts'])} prompts, {_new_tokens(args)} new tokens, temperature {args.temperature}, "
          f"top_p {args.top_p}; "
          f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
          f"graft_tk {m['graft_tk']}")
    return 0


def _new_tokens(args) -> str:
    return str(args.max_new_tokens) if args.max_new_tokens else f"each task's (else {bench.DEFAULT_NEW_TOKENS})"


def _mismatches(summary: dict) -> int:
    return sum((e["exact"] or {}).get("mismatches", 0) for e in summary["all"].values())


def _run(args) -> dict:
    """Validate cheap inputs first (methods, prompts, config) so a typo fails before a model loads."""
    methods = bench.parse_methods(args.methods)
    anchors = parse_anchors(args.anchors)
    if args.n_per_category is not None and args.n_per_category < 1:
        raise InputError(f"--n-per-category must be >= 1, got {args.n_per_category}")
    prompts = load_prompts(args.prompts, args.n_per_category)
    check_sampling_args(args.temperature, args.top_p)
    overrides = {k: v for k, v in (("budget", args.budget), ("tau", args.tau), ("top_k", args.top_k),
                                   ("max_depth", args.max_depth)) if v is not None}
    config = GraftConfig(**overrides)
    named_configs = _named_configs(args.config)

    target = load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
    spec = drafter_spec(args)
    needs_drafter = any(METHODS[m].drafts for m in methods) or "hf_assisted" in anchors
    drafter = (load_drafter(spec, target, args.model, args.dtype, args.device, drafter_quant(args, target))
               if needs_drafter else None)
    if args.profile:
        from ..profiles import find_profile
        profile = find_profile(target, drafter)
        if profile is None:
            raise InputError(f"--profile: no usable profile for {target.name} + "
                             f"{drafter.name if drafter else 'no drafter'} here; run graft-calibrate --model "
                             f"{args.model} first (graft-calibrate --show lists profiles)")
        config = dataclasses.replace(profile.config, **overrides)
        print(f"config from {profile.path}", file=sys.stderr)
    compile, adaptive = bench.BENCH_COMPILE_MODES[args.compile], bench.ADAPTIVE_MODES[args.adaptive]
    if any(adaptive) and config.cost is None:
        from ..calibration.cost import measure_step_cost
        print("measuring the device's cost model (graft-calibrate --cost-only stores it in the profile) ...",
              file=sys.stderr)
        cost = measure_step_cost(target, drafter, config, compile=compile[-1],
                                 progress=lambda msg: print("  " + msg, file=sys.stderr))
        config = dataclasses.replace(config, cost=cost)
    context = 0     # llama.cpp's context: the run's longest prompt + its new tokens
    if any(a in LLAMA_CPP_ANCHORS for a in anchors):
        context = max((len(encode_prompt(target, p.chat, chat=True))
                       + (args.max_new_tokens or p.max_new_tokens or bench.DEFAULT_NEW_TOKENS) for p in prompts), default=0)
    plan = bench.Plan(target, drafter, config, methods, prompts, args.max_new_tokens, args.temperature,
                      args.seed, args.repeats, make_anchors(target, drafter, anchors, gguf_source(args.model), context),
                      top_p=args.top_p, compile=compile, adaptive=adaptive, configs=named_configs, exact=args.exact)

    total = len(prompts) * len(plan.run_names) * args.repeats
    with tqdm(total=total, desc="graft-bench", unit="run", disable=None, file=sys.stderr) as bar:
        def on_run(prompt, name):
            bar.set_postfix_str(f"{prompt.id} {name}", refresh=False)
            bar.update()
        rows = bench.run(plan, on_run)

    report = bench.build_report(plan, rows, dict(vars(args)))
    if args.roofline:
        from ..bench import roofline
        report["roofline"] = roofline.as_json(*roofline.measure(
            target, drafter, budget=config.budget, top_k=config.top_k,
            compile=compile[-1],
            progress=lambda msg: print(msg, file=sys.stderr)))
        if args.plot:
            roofline.plot(report["roofline"], str(args.plot).removesuffix(".png") + "-roofline.png",
                          title=f"{target.name} + {drafter.name if drafter else 'no drafter'}: forwards against "
                                "the memory roofline")
    if compile != (Compile.OFF,):
        print("warm-up (compiles): " + ", ".join(f"{n} {t:.0f} s" for n, t in plan.warmup_seconds.items()),
              file=sys.stderr)
    if args.json:
        bench.write_json(args.json, report)
    if args.plot:
        from ..bench.plots import plot_summary  # matplotlib only when a picture is asked for
        plot_summary(report["summary"], args.plot,
                     title=f"{target.name} + {drafter.name if drafter else 'no drafter'}, "
                           f"{report['config']['dtype']}, {len(prompts)} prompts x {_new_tokens(args)} tokens")
    return report


def _named_configs(specs: list[str]) -> dict[str, GraftConfig]:
    """--config NAME=PROFILE.json, repeatable: the profiles' configs by name (read and checked)."""
    from ..profiles import read_profile
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or not name.replace("-", "").replace("_", "").isalnum():
            raise InputError(f"--config {spec!r}: expected NAME=PROFILE.json, NAME of letters, digits, - and _")
        if name in out:
            raise InputError(f"--config: the name {name!r} is given twice")
        if not Path(path).is_file():
            raise InputError(f"--config {spec!r}: no file {path} (graft-calibrate --show lists profiles)")
        out[name] = read_profile(Path(path)).config
    return out


if __name__ == "__main__":
    sys.exit(main())
