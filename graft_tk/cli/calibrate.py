"""graft-calibrate: find the fastest lossless GraftConfig for a model pair on this machine.

    graft-calibrate --model qwen2.5-coder-1.5b --trials 25 --n-prompts 4
    graft-calibrate --model qwen2.5-coder-1.5b --cost-only
    graft-calibrate --show

Each trial decodes the tuning prompts for real (greedy, timed, output checked against plain
decoding); Optuna's TPE picks the next config. The best config is written as a profile that
``graft_tk.decode`` and graft-generate load by default for this (target, drafter, device, dtype).
Studies live in Optuna storage, so rerunning the same command resumes the search.

The device's cost model (``graft_tk.cost``: target and drafter forwards of 1 .. N tokens, a step's
other work) is measured for the held-out check after the search (``--validate``); with it the
methods that prune choose their depth and budget per step (``graft_tk.policy``), and the profile
keeps it when that is faster on the held-out prompts.
``--cost-only`` measures just the cost model (a few minutes: verifies of up to 64 tokens, after 256
and 2,304 cached tokens, so a step knows what its context costs; without
a tuned profile the budget N becomes the verify's knee, the widest within 1.5x a one-token
forward, and each step verifies the part of it that pays) into the pair's profile, then the
acceptance priors: what the drafter's scores, each retrieval rank and each prompt-lookup match
length are worth on this pair, from decoding the --n-prompts tuning prompts at the full budget.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

from ..bench.prompts import Prompt, load_prompts, spec_bench_path
from ..config import GraftConfig
from ..cost import KNEE_RATIO
from ..errors import CorruptFileError, GraftError, InputError
from ..methods import METHODS
from ..models import load_model
from ..sampling import check_sampling_args
from ._models import add_quant_args, at_least, drafter_quant, drafter_spec, load_drafter

COST_WIDTH = 64   # --cost-only measures verifies (and drafter forwards) up to this many tokens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graft-calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target: built-in name, checkpoint folder, .gguf file or cached HF repo id "
                                   "(e.g. qwen3 = Qwen/Qwen3-8B from the local HF cache)")
    p.add_argument("--eagle3", default=None, metavar="PATH",
                   help="calibrate with this EAGLE-3 head folder as the drafter (instead of --drafter)")
    p.add_argument("--drafter", default=None,
                   help="a model name or path, self:L (the target's first L layers) or none "
                        "(default: the registry's pair for --model)")
    p.add_argument("--methods", default="graft",
                   help="comma list searched as a parameter too, e.g. graft,pruned,pld (default: %(default)s)")
    p.add_argument("--prompts", default=None,
                   help="humaneval | spec-bench | math | mix | PATH.jsonl (Spec-Bench 'turns' or one 'prompt' per "
                        "line), or a comma list (default: mix = HumanEval, Spec-Bench's categories and math; "
                        "without Spec-Bench's data: humaneval#6,math#6)")
    p.add_argument("--n-prompts", type=at_least(1), default=4, help="tuning prompts (default: %(default)s)")
    p.add_argument("--validate", type=at_least(0), default=4, metavar="N",
                   help="afterwards, time best vs default on N other prompts from --prompts (0 = skip; default 4)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--trials", type=at_least(1), default=20, help="trials to run in this invocation (default: %(default)s)")
    p.add_argument("--timeout", type=at_least(0, float), default=None, help="stop starting trials after this many seconds")
    p.add_argument("--objectives", default="speed", choices=["speed", "speed,mat"],
                   help="speed: maximise tokens/s (prunes hopeless trials); speed,mat: Pareto front of both")
    p.add_argument("--repeats", type=at_least(1), default=1, help="timed decodes per prompt and trial (median kept)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: sqlite under GRAFT_TK_HOME)")
    p.add_argument("--study-name", default=None, help="default: derived from model, drafter, device, dtype")
    p.add_argument("--profile-dir", default=None, help="where profiles go (default: GRAFT_TK_PROFILE_DIR or "
                                                       "GRAFT_TK_HOME/profiles; decode reads the same place)")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default bf16)")
    add_quant_args(p)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="TPE sampler seed (and the decodes' sampling seed)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="calibrate for sampling at this temperature (default 0: greedy, outputs checked against ar)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus cut when sampling (default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="decode with compiled step forwards (torch.compile; each budget N tried compiles a graph)")
    p.add_argument("--cost-only", action="store_true",
                   help="only measure the device's cost model and learn the acceptance priors (on --n-prompts "
                        "prompts) into this pair's profile (keeps its config; the default config when there "
                        "is no profile yet)")
    p.add_argument("--batch", type=at_least(1), default=1, metavar="B",
                   help="calibrate for B requests decoded together (graft-serve --max-batch): tau, N and D only, "
                        "scored by the batch's output tokens/s; the profile is the pair's for batch size B "
                        "(default: %(default)s)")
    p.add_argument("--show", action="store_true", help="list profiles and studies, then exit")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        if args.show:
            return show(args)
        if not args.model:
            raise InputError("--model is required (or --show)")
        return run(args)
    except GraftError as e:
        print(f"graft-calibrate: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    from ..calibration import report, search
    from ..profiles import profile_key, write_profile
    from ..calibration.cost import measure_step_cost

    methods = tuple(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    bad = [m for m in methods if m not in METHODS or m == "ar"]
    if bad or not methods:
        raise InputError(f"--methods: unknown or not speculative: {', '.join(bad) or args.methods!r}; "
                         f"choose from {', '.join(m for m in METHODS if m != 'ar')}")
    check_sampling_args(args.temperature, args.top_p)
    if args.n_prompts < 1 or args.validate < 0:
        raise InputError("--n-prompts must be >= 1 and --validate >= 0")
    target = load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
    spec = drafter_spec(args)
    if spec is None and any(METHODS[m].drafts for m in methods):
        raise InputError(f"no known drafter pairs with {args.model}: pass --drafter NAME (same tokenizer), "
                         "--drafter self:L, --eagle3 PATH, or --drafter none --methods retrieval,pld")
    drafter = load_drafter(spec, target, args.model, dtype=args.dtype, device=args.device,
                           quant=drafter_quant(args, target))
    if args.cost_only:
        return run_cost_only(args, target, drafter)
    args.prompts = args.prompts or default_prompts()
    tune, held_out = split_prompts(load_prompts(args.prompts), args.n_prompts, args.validate)
    base = None
    if args.batch > 1:   # tau, N and D for this batch size; the rest is the pair's (its profile, else the default)
        from ..profiles import find_profile
        single = find_profile(target, drafter)
        base, held_out = (single.config if single else GraftConfig()), []
        print(f"batch {args.batch}: searching tau, N and D; the rest from "
              f"{single.path if single else 'the default config'}", file=sys.stderr)
    task = search.Task(target=target, drafter=drafter, prompts=tune, validation=held_out,
                       max_new_tokens=args.max_new_tokens, methods=methods, objectives=args.objectives,
                       repeats=args.repeats, seed=args.seed, temperature=args.temperature, top_p=args.top_p,
                       compile=args.compile, batch=args.batch, base=base)
    storage = args.storage or search.default_storage()
    # compiled forwards have their own cost curve: their trials go to a study of their own
    name = args.study_name or (search.default_study_name(target, drafter, args.objectives, args.batch)
                               + ("-compiled" if args.compile else ""))
    study = search.open_study(storage, name, task)
    print(f"study {name!r} in {storage}: {len(study.trials)} earlier trials; running {args.trials} more "
          f"on {len(tune)} prompts x {args.max_new_tokens} tokens", file=sys.stderr)

    bar = tqdm(total=args.trials, desc="trials", unit="trial")

    def on_trial(study, trial):
        best = search.best_trial(study)
        bar.set_postfix_str(f"best {best.values[0]:.2f} tok/s (#{best.number})" if best else "no complete trial")
        bar.update(1)

    outcome = search.calibrate(task, study, args.trials, args.timeout, on_trial=on_trial,
                               log=lambda msg: bar.write(msg))
    bar.close()
    profile_path = png = None
    if outcome.best is not None:
        method, config = search.config_of(outcome.best)
        chosen = "best"
        if held_out:   # the cost model is kept only where the held-out check finds it faster
            print("measuring the device's cost model and the acceptance priors ...", file=sys.stderr)
            cost = measure_step_cost(target, drafter, config, compile=args.compile, progress=_say)
            priors = search.learn_priors(target, drafter, method, config, tune, args.max_new_tokens, args.compile,
                                         _say)
            config = dataclasses.replace(config, priors=priors)
            adaptive = dataclasses.replace(config, cost=cost)
            default_method, default_config = ("graft" if "graft" in methods else methods[0]), GraftConfig(priors=priors)
            print(f"held-out check on {len(held_out)} prompts: best vs best adaptive vs default ...",
                  file=sys.stderr)
            candidates = {"best": (method, config), "best_adaptive": (method, adaptive),
                          "default": (default_method, default_config)}
            outcome.validation = search.validate(task, candidates)
            v, bad = outcome.validation["tokens_per_s"], outcome.validation["mismatches"]
            chosen = max((name for name in candidates if not bad[name]), key=lambda name: v[name], default="default")
            method, config = candidates[chosen]
        b = outcome.best
        measured = {"chosen": chosen, "trial": b.number, "tokens_per_s": b.values[0],
                    "speedup_vs_ar": b.user_attrs["speedup_vs_ar"], "mat": b.user_attrs["mat"],
                    "ar_tokens_per_s": outcome.ar_tokens_per_s,
                    "default_tokens_per_s": outcome.default.values[0] if outcome.default else None,
                    "warm_start_tau": outcome.warm.tau if outcome.warm else None,
                    "validation": outcome.validation, "study": name, "storage": storage,
                    "prompts": args.prompts, "tuning_prompts": [p.id for p in tune],
                    "max_new_tokens": args.max_new_tokens, "trials": len(study.trials), "batch": args.batch,
                    "calibrated_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        key = profile_key(target, drafter, args.batch)
        profile_path = write_profile(key, method, config, measured, Path(args.profile_dir) if args.profile_dir else None)
        png = report.plot_trials(study, profile_path.with_suffix(".png"), f"{target.name} + "
                                 f"{drafter.name if drafter else 'no drafter'}, {key.dtype}, {key.device}")
        if chosen == "default":
            print("note: the tuned config did not beat the default on the held-out prompts; the profile keeps "
                  "the default config", file=sys.stderr)
        elif chosen == "best" and held_out:
            print("note: choosing depth and budget per step was slower on the held-out prompts than the tuned "
                  "fixed config; the profile keeps the fixed config (graft-calibrate --cost-only adds the "
                  "cost model anyway)", file=sys.stderr)
    print(report.summary(outcome, profile_path, png))
    return 0 if outcome.best is not None else 1


def run_cost_only(args, target, drafter) -> int:
    """Measure the cost model into this pair's profile (its config kept, else the default), then
    learn the acceptance priors with it on --n-prompts tuning prompts."""
    from ..profiles import find_profile, profile_key, write_profile
    from ..calibration.search import learn_priors
    from ..calibration.cost import measure_step_cost

    directory = Path(args.profile_dir) if args.profile_dir else None
    profile = find_profile(target, drafter, directory)
    method, config, measured = ((profile.method, profile.config, profile.measured) if profile is not None
                                else ("graft" if drafter is not None else "retrieval", GraftConfig(), {}))
    widest = max(config.budget, COST_WIDTH)
    print(f"measuring the cost model of {target.name} + {drafter.name if drafter else 'no drafter'} "
          f"up to {widest} tokens ...", file=sys.stderr)
    cost = measure_step_cost(target, drafter, config, compile=args.compile, progress=_say, n_max=widest)
    tune, _ = split_prompts(load_prompts(args.prompts or default_prompts()), args.n_prompts, 0)
    priors = learn_priors(target, drafter, method, config, tune, args.max_new_tokens, args.compile, _say)
    config = dataclasses.replace(config, cost=cost, priors=priors)
    if profile is None:   # no tuned N: the verify's knee (the policy chooses each step's width below it)
        config = dataclasses.replace(config, budget=cost.knee())
        print(f"budget N = {config.budget}: the widest verify within {KNEE_RATIO}x a one-token forward",
              file=sys.stderr)
    measured = {**measured, "cost_measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "priors_prompts": [p.id for p in tune]}
    path = write_profile(profile_key(target, drafter), method, config, measured, directory)
    print(cost_table(cost))
    print(priors_table(config.priors))
    print(f"\nprofile: {path} (decode now chooses depth and budget per step for {method})")
    return 0


def _say(message: str) -> None:
    """Progress of a long measurement, indented under its heading (stderr)."""
    print("  " + message, file=sys.stderr)


def default_prompts() -> str:
    """mix = HumanEval, Spec-Bench's categories and math; without Spec-Bench's data, HumanEval and the first
    six math problems."""
    return "mix" if spec_bench_path() is not None else "humaneval#6,math#6"


def priors_table(priors) -> str:
    """The learnt acceptance priors, one entry per source (each indexed its own way: the drafter by
    score bucket, retrieval by rank, prompt lookup and suffix decoding by match length)."""
    fmt = lambda p: ", ".join(f"{x:.2f}" for x in p.rates)   # noqa: E731
    return "acceptance priors: " + "; ".join(f"{name} [{fmt(p)}]" for name, p in
                                             [("draft", priors.draft), *priors.sources.items()])


def cost_table(cost) -> str:
    """The cost model as a markdown table: ms per forward of n tokens, target (and its growth per
    1,000 more cached tokens) and drafter."""
    n = len(cost.verify_ms)
    lines = ["| tokens | target forward (ms) | + per 1k cached (ms) | drafter forward (ms) |", "|---|---|---|---|"]
    for i in range(n):
        d = f"{cost.draft_ms[i]:.1f}" if i < len(cost.draft_ms) else "n.a."
        g = f"{cost.verify_ms_per_1k[i]:.1f}" if i < len(cost.verify_ms_per_1k) else "n.a."
        lines.append(f"| {i + 1} | {cost.verify_ms[i]:.1f} | {g} | {d} |")
    lines.append(f"\nthe rest of a step: {cost.step_ms:.1f} ms; measured after {cost.context} cached tokens")
    return "\n".join(lines)


def split_prompts(prompts: list[Prompt], n_tune: int, n_validate: int) -> tuple[list[Prompt], list[Prompt]]:
    """Round-robin over categories (so a mixed file tunes on all of them), then tune / held-out."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    mixed = [q for group in _zip_longest(*by_cat.values()) for q in group if q is not None]
    if len(mixed) < n_tune + n_validate:
        raise InputError(f"need {n_tune} tuning + {n_validate} held-out prompts, the source has {len(mixed)}; "
                         "lower --n-prompts / --validate or pass a larger prompt file")
    return mixed[:n_tune], mixed[n_tune:n_tune + n_validate]


def _zip_longest(*lists):
    n = max(map(len, lists), default=0)
    return [tuple(lst[i] if i < len(lst) else None for lst in lists) for i in range(n)]


def show(args) -> int:
    import optuna

    from ..calibration import search
    from ..profiles import list_profiles, profile_dir

    directory = Path(args.profile_dir) if args.profile_dir else profile_dir()
    entries = list_profiles(directory)
    print(f"profiles in {directory}: {len(entries) or 'none'}")
    for path, prof in entries:
        if isinstance(prof, CorruptFileError):
            print(f"  {path.name}: UNUSABLE — {prof}")
            continue
        c, m = prof.config, prof.measured
        print(f"  {path.name}\n    {prof.key.target} + {prof.key.drafter or 'no drafter'} | {prof.key.device} | "
              f"{prof.key.dtype} | graft_tk {prof.key.graft_tk}\n    {prof.method}: tau={c.tau:.3g} N={c.budget} "
              f"K={c.top_k} D={c.max_depth} k={c.retrieval_k} template={c.template}; "
              + (f"{m['tokens_per_s']:.2f} tok/s, {m['speedup_vs_ar']:.2f}x ar (tuning prompts), calibrated "
                 f"{m.get('calibrated_at', '?')}" if "tokens_per_s" in m else "config not searched"))
        if c.cost is not None:
            print(f"    adaptive: cost model of forwards of 1 .. {len(c.cost.verify_ms)} tokens "
                  f"({c.cost.verify_ms[0]:.0f} .. {c.cost.verify_ms[-1]:.0f} ms target), measured "
                  f"{m.get('cost_measured_at', m.get('calibrated_at', '?'))}")
        if c.priors is not None:
            print("    " + priors_table(c.priors))
    storage = args.storage or search.default_storage()
    try:
        studies = optuna.get_all_study_summaries(storage)
    except Exception as e:  # noqa: BLE001
        raise InputError(f"cannot open Optuna storage {storage!r}: {type(e).__name__}: {e}") from e
    print(f"studies in {storage}: {len(studies) or 'none'}")
    for s in studies:
        best = f", best {s.best_trial.values[0]:.2f} tok/s" if s.best_trial is not None and s.best_trial.values else ""
        print(f"  {s.study_name}: {s.n_trials} trials{best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
