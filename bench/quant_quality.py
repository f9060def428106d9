"""What weight quantization costs in quality: HumanEval pass@1 and greedy agreement per format.

    python bench/quant_quality.py --model qwen2.5-coder-1.5b --quants none,int8,int4 --n 20 [--json OUT]

Each of the first ``--n`` HumanEval problems is asked as graft-bench asks it ("Complete this
Python function." + the problem's prompt, chat template applied) and decoded greedily (``ar``; every
speculative method gives the same tokens) by the model in each format, one after another on each
problem. Decoding stops at EOS, at ``--max-new-tokens`` or when the answer's first code block
closes. The completion is that code block (the whole answer when it has none): run after the
problem's prompt (a complete function redefines the prompt's stub; a bare body completes it),
then the problem's tests, in a fresh Python process with a time limit. pass@1 is the fraction
that pass (one greedy sample per problem); agreement counts the tokens each format shares with the
first format's output before the first difference.

This runs code a model wrote, as HumanEval's own harness does: in a subprocess, in a temporary
folder, killed after ``--timeout`` seconds. Run it where that is acceptable.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm.auto import tqdm

import graft_tk
from graft_tk._fs import atomic_write_text
from graft_tk.decode import encode_prompt
from graft_tk.bench.prompts import HUMANEVAL_INSTRUCTION, humaneval_problems

from quant_decode import agreement

FENCE = re.compile(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(answer: str) -> str:
    """The first fenced code block of a chat answer, else the answer itself."""
    m = FENCE.search(answer)
    return m.group(1) if m else answer


def block_closed(answer: str) -> bool:
    """The answer's first code block has opened and closed: the rest is prose."""
    return FENCE.search(answer) is not None


def program(problem: dict, completion: str) -> str:
    """The problem's prompt, the completion and the problem's tests as one script."""
    entry = problem["entry_point"]
    if re.search(rf"^\s*def {re.escape(entry)}\s*\(", completion, re.MULTILINE):
        # a complete function: after the prompt (whose stub is a valid docstring-only function, and
        # whose imports the answer may rely on), its definition replaces the stub
        body = "\n\n" + completion
    else:
        body = completion    # a bare body continues the prompt's function
    return f"{problem['prompt']}{body}\n\n{problem['test']}\n\ncheck({entry})\n"


def passes(problem: dict, completion: str, timeout: float = 10.0) -> bool:
    """Whether the completion passes the problem's tests, in a fresh interpreter within ``timeout`` s."""
    with tempfile.TemporaryDirectory(prefix="graft-humaneval-") as tmp:
        script = Path(tmp) / "check.py"
        script.write_text(program(problem, completion))
        try:
            r = subprocess.run([sys.executable, "-I", str(script)], cwd=tmp, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
    return r.returncode == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--quants", default="none,int8,int4", help="comma list; the first is the agreement reference")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--n", type=int, default=20, help="the first N HumanEval problems (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds each program may run")
    p.add_argument("--json", default=None, help="every answer and verdict, written after each problem; a run "
                                               "with the same arguments resumes from it")
    args = p.parse_args()
    quants = args.quants.split(",")
    problems = humaneval_problems()[:args.n]
    runs = _resumed(args)
    done = {r["task_id"] for r in runs}
    models = {q: graft_tk.load_model(args.model, dtype=args.dtype, quant=q) for q in quants}
    t0 = time.perf_counter()
    todo = [problem for problem in problems if problem["task_id"] not in done]
    for problem in tqdm(todo, desc="humaneval", unit="problem", file=sys.stderr, initial=len(problems) - len(todo),
                        total=len(problems)):
        reference = None
        for quant in quants:
            model = models[quant]
            seen: list[int] = []

            def stop_at_closed_block(new, model=model, seen=seen):
                seen.extend(new)
                return block_closed(model.tokenizer.decode(seen))
            ids = encode_prompt(model, HUMANEVAL_INSTRUCTION + problem["prompt"], chat=True)
            r = graft_tk.decode(model, ids, max_new_tokens=args.max_new_tokens, on_tokens=stop_at_closed_block)
            reference = r.tokens if reference is None else reference
            completion = extract_code(r.text)
            runs.append({"task_id": problem["task_id"], "quant": quant, "tokens": len(r.tokens),
                         "agree": agreement(r.tokens, reference), "identical": r.tokens == reference,
                         "passed": passes(problem, completion, args.timeout), "answer": r.text})
        _write(args, runs, None)
    minutes = (time.perf_counter() - t0) / 60

    print(f"\n{args.model}, {args.dtype} activations, HumanEval/0-{args.n - 1} ({args.n} problems), greedy, "
          f"up to {args.max_new_tokens} new tokens; {minutes:.0f} min\n")
    print(f"| weights | pass@1 | passed | tokens agreeing with {quants[0]} | outputs identical to {quants[0]} |")
    print("|---|---|---|---|---|")
    summary = {}
    for quant in quants:
        mine = [r for r in runs if r["quant"] == quant]
        summary[quant] = {"pass_at_1": sum(r["passed"] for r in mine) / len(mine),
                          "passed": [r["task_id"] for r in mine if r["passed"]],
                          "agree": sum(r["agree"] for r in mine), "tokens": sum(r["tokens"] for r in mine),
                          "identical": sum(r["identical"] for r in mine)}
        s = summary[quant]
        print(f"| {quant} | {100 * s['pass_at_1']:.0f}% | {len(s['passed'])}/{len(mine)} | {s['agree']}/{s['tokens']} "
              f"| {s['identical']}/{len(mine)} |")
    _write(args, runs, summary)


def _resumed(args) -> list[dict]:
    """The runs of an earlier, interrupted call with the same arguments (its --json), else none."""
    if not args.json or not Path(args.json).exists():
        return []
    saved = json.loads(Path(args.json).read_text())
    if saved.get("args") != vars(args):
        raise SystemExit(f"{args.json} holds a run with other arguments ({saved.get('args')}); "
                         "pass another --json or delete it")
    return saved["runs"]   # written after each whole problem: every format's answer is there


def _write(args, runs: list[dict], summary: dict | None) -> None:
    if args.json:
        atomic_write_text(Path(args.json), json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
