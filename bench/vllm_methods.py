"""vLLM's speculative methods against the Graft proposer, inside vLLM's CPU build, on one set of prompts.

    .venv-vllm/bin/python -m bench.vllm_methods --prompts PROMPTS.jsonl --max-tokens 64 \\
        --out docs/benchmarks/<date>/vllm

Every method runs in its own process (vLLM builds one engine per process), one after another, the
whole list ``--rounds`` times (interleaved: a slow spell of the machine hits every method alike):

* ``none``: plain decoding;  ``ngram``: vLLM's prompt lookup;  ``suffix``: vLLM's suffix decoding
  (arctic-inference; skipped with a note where it does not import);  ``draft_model``: the 0.5B
  drafter as vLLM's own draft model;  ``graft``: graft_tk's proposer (``graft_tk.integrations.vllm``);
* ``graft_tk``: the same prompts through graft_tk's own engine (``graft_tk.decode``, method graft, a
  tree verify) for comparison.

Each prompt is decoded alone (batch 1: the latency a user sees), greedily, after one warm-up prompt.
Reported per method: tokens/s (the median over rounds of new tokens / decode seconds, all prompts),
its ratio to ``none``, accepted tokens per verify step, and whether every output equals ``none``'s
token for token. Written: OUT.json and OUT.md (the table, with the command).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("none", "ngram", "suffix", "draft_model", "graft", "graft_tk")


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # one process: the proposer's stats are readable
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # vLLM otherwise drops to 1 thread on a small CPU
    return env


def speculative_config(method: str, args) -> tuple[dict | None, dict]:
    """(speculative_config, additional_config) of a vLLM method."""
    k = args.k
    if method == "none":
        return None, {}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}, {}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}, {}
    if method == "draft_model":
        return {"method": "draft_model", "model": _folder(args.drafter), "num_speculative_tokens": k}, {}
    if method == "graft":
        from graft_tk.integrations.vllm import PROPOSER
        return ({"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k},
                {"graft": {"drafter": args.drafter}})
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def _folder(model: str) -> str:
    from graft_tk.models import resolve
    return str(resolve(model)[1])


def _prompt_ids(args) -> list[list[int]]:
    from graft_tk.bench.prompts import load_prompts
    from graft_tk.decode import encode_prompt
    from graft_tk.models import Tokenizer
    from types import SimpleNamespace

    tok = SimpleNamespace(tokenizer=Tokenizer(Path(_folder(args.model))))
    return [encode_prompt(tok, p.text, chat=True) for p in load_prompts(args.prompts)]


def worker(method: str, args) -> dict:
    """One method over every prompt, in this process."""
    prompts = _prompt_ids(args)
    if method == "graft_tk":
        return _graft_tk_worker(prompts, args)
    from vllm import LLM, SamplingParams

    spec, extra = speculative_config(method, args)
    kwargs = dict(speculative_config=spec, additional_config=extra) if spec else {}
    llm = LLM(model=_folder(args.model), dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
              max_num_seqs=4, disable_log_stats=False, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)      # warm-up
    before = _spec_counters(llm)
    outputs, seconds = [], []
    for ids in prompts:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - t0)
        outputs.append(list(out.outputs[0].token_ids))
    after = _spec_counters(llm)
    steps, accepted = after[0] - before[0], after[1] - before[1]
    result = dict(method=method, seconds=seconds, outputs=outputs,
                  accepted_per_step=accepted / steps if steps else None, drafts=steps)
    if method == "graft":
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        result["graft_stats"] = runner.drafter.stats
    return result


def _spec_counters(llm) -> tuple[float, float]:
    """(verify steps with drafts, accepted draft tokens) so far, from vLLM's metrics."""
    steps = accepted = 0.0
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            steps += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += m.value
    return steps, accepted


def _graft_tk_worker(prompts: list[list[int]], args) -> dict:
    import torch

    import graft_tk

    dtype = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    target = graft_tk.load_model(args.model, dtype=dtype, progress=False)
    quant = "int4-all" if dtype == "bf16" else "none"
    drafter = graft_tk.load_model(args.drafter, dtype=dtype, quant=quant, progress=False)
    torch.set_num_threads(int(_env()["OMP_NUM_THREADS"]))
    run = lambda ids: graft_tk.decode(target, ids, drafter=drafter, method="graft",   # noqa: E731
                                      max_new_tokens=args.max_tokens)
    run(prompts[0])
    outputs, seconds, steps, accepted = [], [], 0, 0
    for ids in prompts:
        t0 = time.perf_counter()
        r = run(ids)
        seconds.append(time.perf_counter() - t0)
        outputs.append(r.tokens)
        steps += r.stats["steps"]
        accepted += len(r.tokens) - r.stats["steps"]
    return dict(method="graft_tk", seconds=seconds, outputs=outputs, accepted_per_step=accepted / max(steps, 1),
                drafts=steps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    parser.add_argument("--prompts", required=True, help="a JSONL of {id, category, prompt} (graft_tk.bench.prompts)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens of every method")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args)), flush=True)
        return
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    notes: dict[str, str] = {}
    base = list(argv if argv is not None else sys.argv[1:])
    for r in range(args.rounds):
        for m in methods:
            if m in notes:
                continue
            print(f"[round {r + 1}/{args.rounds}] {m} ...", file=sys.stderr, flush=True)
            proc = subprocess.run([sys.executable, "-m", "bench.vllm_methods", *base, "--worker", m],
                                  env=_env(), capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                notes[m] = f"failed (exit {proc.returncode}): " + proc.stderr.strip().splitlines()[-1][:300]
                print(f"  {notes[m]}", file=sys.stderr)
                continue
            runs[m].append(json.loads(line[len("RESULT "):]))
    report = summarize(runs, notes, args)
    print(report["table"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(dict(report, runs=runs), indent=1))
        args.out.with_suffix(".md").write_text(report["table"] + "\n")


def summarize(runs: dict, notes: dict, args) -> dict:
    ref = runs["none"][0]["outputs"] if runs.get("none") else None
    figures = {}
    for m, rs in runs.items():
        if rs:
            figures[m] = dict(
                tokens_per_s=statistics.median(sum(len(o) for o in r["outputs"]) / sum(r["seconds"]) for r in rs),
                accepted_per_step=rs[0]["accepted_per_step"],
                identical_to_none=None if ref is None else all(r["outputs"] == ref for r in rs),
                **({"graft_stats": rs[0]["graft_stats"]} if "graft_stats" in rs[0] else {}))
    none = figures.get("none", {}).get("tokens_per_s")
    rows = []
    for m in runs:
        f = figures.get(m)
        if f is None:
            rows.append(f"| {m} | {notes.get(m, 'not run')} | | | |")
            continue
        ratio = f"{f['tokens_per_s'] / none:.2f}x" if none else ""
        acc = "" if f["accepted_per_step"] is None else f"{f['accepted_per_step']:.2f}"
        same = {None: "", True: "yes", False: "**no**"}[f["identical_to_none"]]
        rows.append(f"| {m} | {f['tokens_per_s']:.2f} | {ratio} | {acc} | {same} |")
    cmd = "python -m bench.vllm_methods " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("worker", "out") and v is not None)
    table = "\n".join([f"`{cmd}`", "", "| method | tokens/s | vs none | accepted / verify step | output = none |",
                       "|---|---|---|---|---|", *rows])
    return dict(figures=figures, notes=notes, table=table)


if __name__ == "__main__":
    main()
