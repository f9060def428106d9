"""graft-bench's logic: run every method on every prompt, check exactness, summarise, report.

How the comparison is kept fair (and why):

- **Cold, equal start.** Each (prompt, method) run gets a fresh ``Engine``, so every speculative
  method starts with an empty adjacency matrix (warmed only from that prompt's prefill) and no
  method profits from state an earlier prompt or method left behind. ``ar`` keeps no state.
- **Interleaved.** All methods run on one prompt before the next prompt starts, in an order
  rotated by one per prompt: a machine that slows down mid-run (other load, thermals) slows every
  method alike instead of whichever happens to run last.
- **Warm-up excluded.** One untimed short decode per method on the first prompt absorbs
  allocator growth, lazy initialisation and first-call overheads.
- **Medians for time, pooled sums for counts.** tokens/s of a run is ``stats["tokens_per_s"]``
  (prefill included, as a user waits for it), the median over ``repeats``; a category reports the
  median over its prompts, and speedup is the median over prompts of tok/s relative to ``ar`` on
  the same prompt (pairing cancels prompt-to-prompt differences). MAT, drafter forwards, accepted
  tokens and the time split are deterministic counts: summed over prompts, then divided.
- **Exactness is never hidden.** At temperature 0 every method's tokens must equal ``ar``'s
  (``ar`` always runs as the baseline); mismatches are counted and marked in the table. The HF
  anchors run the same weights and are held to it too; llama.cpp runs its own kernels on the GGUF
  blocks, so its rows say n.a. (its tokens are in the JSON).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from graft_tk._fs import atomic_write_text
from graft_tk._version import __version__
from graft_tk.compiled import Compile
from graft_tk.config import GraftConfig
from graft_tk.decode import decode, encode_prompt
from graft_tk.errors import InputError
from graft_tk.methods import METHODS
from graft_tk.models import Model
from graft_tk.models.eagle3 import Eagle3Head

from .anchors import ANCHOR_NAMES, LLAMA_CPP_ANCHORS, Anchors
from .prompts import Prompt

WARMUP_TOKENS = 8
DEFAULT_NEW_TOKENS = 64   # new tokens per prompt when neither --max-new-tokens nor the prompt's task sets them
PHASES = ("prefill", "draft", "retrieve", "verify", "commit")


def parse_methods(text: str) -> tuple[str, ...]:
    """``"tree,graft"`` -> ``("ar", "tree", "graft")``: validated against METHODS at run time, ar first."""
    available = list(METHODS)
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in available]
    if unknown or not names:
        raise InputError(f"unknown method(s) {', '.join(unknown) or repr(text)}; available: {', '.join(available)}")
    return ("ar",) + tuple(dict.fromkeys(m for m in names if m != "ar"))


@dataclass
class Plan:
    """Everything one benchmark run needs."""
    target: Model
    drafter: Model | Eagle3Head | None
    config: GraftConfig
    methods: tuple[str, ...]        # ours, "ar" first
    prompts: list[Prompt]
    max_new_tokens: int | None      # new tokens per prompt; None: each prompt's own (its task's), else DEFAULT_NEW_TOKENS
    temperature: float = 0.0
    seed: int = 0
    repeats: int = 1
    anchors: Anchors | None = None
    top_p: float = 1.0
    # The scopes every method runs compiled with, one run each (graft_tk.compiled): (OFF,) eager;
    # (OFF, ON) each method eager and as "<method>:compiled", in one interleaved run
    compile: tuple[Compile, ...] = (Compile.OFF,)
    # Whether the methods that prune draft at the config's fixed tau and D (False) or choose
    # whether to draft and how deep per step from ``config.cost`` (True, graft_tk.policy); (False,
    # True): each such method twice, fixed and as "<method>:adaptive"
    adaptive: tuple[bool, ...] = (False,)
    # name -> config: each method but ar runs again as "<method>@name" with that config as it is
    # (e.g. a profile tuned on another workload), fixed unless the config carries a cost model
    configs: dict = field(default_factory=dict)
    exact: bool = False      # every run (ar too) with row-invariant target forwards (graft_tk.models.exact)
    warmup_seconds: dict = field(default_factory=dict)   # per run name: the untimed first call (compiles)

    def __post_init__(self):
        self.compile, self.adaptive = tuple(self.compile), tuple(self.adaptive)
        if not self.compile or not all(isinstance(c, Compile) for c in self.compile):
            raise InputError(f"compile must be graft_tk.compiled.Compile scopes, got {self.compile!r} "
                             f"(graft-bench --compile takes {', '.join(BENCH_COMPILE_MODES)})")
        if not self.adaptive or not all(isinstance(a, bool) for a in self.adaptive):
            raise InputError(f"adaptive must be booleans, got {self.adaptive!r}")
        if any(self.adaptive) and self.config.cost is None:
            raise InputError("--adaptive needs the device's cost model in the config: run graft-calibrate "
                             "--cost-only and pass --profile")
        if self.repeats < 1:
            raise InputError(f"--repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.prompts:
            raise InputError("no prompts to run")
        missing = [m for m in self.methods if METHODS[m].drafts]
        if missing and self.drafter is None:
            raise InputError(f"method(s) {', '.join(missing)} need a drafter: pass --drafter NAME or "
                             "--drafter self:L (the target's first L layers)")

    @property
    def runs(self) -> tuple[Run, ...]:
        """Our runs: the methods; each that prunes once per ``adaptive`` choice; each but ar again
        with every named config; all of them once per ``compile`` scope. A label carries the
        choices the plan varies: "<method>[@config][:adaptive][:compiled]"."""
        two_ways, two_scopes = len(self.adaptive) > 1, len(self.compile) > 1
        runs = [Run(m + (":adaptive" if a and two_ways else ""), m, adaptive=a and METHODS[m].prune)
                for a in self.adaptive for m in self.methods if not (a and two_ways) or METHODS[m].prune]
        runs += [Run(f"{m}@{c}", m, config=c) for c in self.configs for m in self.methods if m != "ar"]
        return tuple(replace(r, name=r.name + (":compiled" if two_scopes and c is Compile.ON else ""), compile=c)
                     for c in self.compile for r in runs)

    @property
    def our_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.runs)

    @property
    def run_names(self) -> tuple[str, ...]:
        """Our runs, then the anchors still runnable."""
        return self.our_names + (self.anchors.names if self.anchors else ())

    def compile_scope(self, name: str) -> Compile:
        """What run ``name`` compiles (an anchor: nothing of ours)."""
        run = next((r for r in self.runs if r.name == name), None)
        return run.compile if run is not None else Compile.OFF

    def new_tokens(self, prompt: Prompt) -> int:
        """The tokens ``prompt`` decodes: --max-new-tokens when given, else its task's, else DEFAULT_NEW_TOKENS."""
        return self.max_new_tokens or prompt.max_new_tokens or DEFAULT_NEW_TOKENS

    def run_once(self, name: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        run = next((r for r in self.runs if r.name == name), None)
        if run is None:
            return self.anchors.run(name, ids, max_new_tokens, self.temperature, self.seed, self.top_p)
        if run.config is not None:
            config = self.configs[run.config]
        else:
            config = self.config if run.adaptive else replace(self.config, cost=None)
        return cold_decode(self.target, self.drafter, run.method, config, ids, max_new_tokens, self.temperature,
                           self.seed, self.top_p, run.compile, self.exact)


@dataclass(frozen=True)
class Run:
    """One of our runs in a plan: its label, its method, and how it runs."""
    name: str
    method: str
    compile: Compile = Compile.OFF   # what its step forwards compile
    adaptive: bool = False           # the device's cost model steers it (graft_tk.policy.StepPolicy)
    config: str | None = None        # one of Plan.configs by name (None: the plan's config)


BENCH_COMPILE_MODES = {"off": (Compile.OFF,), "drafter": (Compile.DRAFTER,), "on": (Compile.ON,),
                       "both": (Compile.OFF, Compile.ON)}       # graft-bench --compile -> Plan.compile
ADAPTIVE_MODES = {"off": (False,), "on": (True,), "both": (False, True)}   # --adaptive -> Plan.adaptive


def cold_decode(target: Model, drafter: Model | Eagle3Head | None, method: str, config: GraftConfig,
                ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                seed: int = 0, top_p: float = 1.0, compile: Compile = Compile.OFF,
                exact: bool = False) -> tuple[list[int], dict]:
    """One decode from a fresh engine (cold adjacency matrix, no state from earlier runs): (tokens, stats)."""
    r = decode(target, ids, method=method, drafter=drafter, config=config, max_new_tokens=max_new_tokens,
               temperature=temperature, top_p=top_p, seed=seed, compile=compile, exact=exact)
    return r.tokens, r.stats


def run(plan: Plan, on_run: Callable[[Prompt, str], None] | None = None) -> list[dict]:
    """Run the plan; one row per (prompt, method or anchor). ``on_run`` is called after every run."""
    context = plan.target.config.max_position_embeddings
    encoded = []
    for p in plan.prompts:
        ids = encode_prompt(plan.target, p.chat, chat=True)
        if len(ids) + plan.new_tokens(p) > context:
            raise InputError(f"prompt {p.id} ({len(ids)} tokens) + {plan.new_tokens(p)} new tokens exceeds "
                             f"{plan.target.name}'s context of {context}; lower --max-new-tokens or drop the prompt")
        encoded.append((p, ids))
    for name in plan.run_names:   # untimed; compiles the graphs of a compiled run
        # A compiled run decodes the whole first prompt: a drafter compiles a graph per kind of
        # forward (one pending token or several, one frontier row or several), and an 8-token
        # warm-up, one step, left some to compile inside a timed run (94 s on the Qwen pair).
        compiled = plan.compile_scope(name) is not Compile.OFF
        first = plan.new_tokens(encoded[0][0])
        tokens = first if compiled else min(WARMUP_TOKENS, first)
        t = time.perf_counter()
        _guarded(plan, name, encoded[0][1], tokens)
        plan.warmup_seconds[name] = time.perf_counter() - t

    rows = []
    for i, (prompt, ids) in enumerate(encoded):
        names = plan.run_names
        order = names[i % len(names):] + names[:i % len(names)]
        results: dict[str, list] = {n: [] for n in names}
        for _ in range(plan.repeats):
            for name in order:
                out = _guarded(plan, name, ids, plan.new_tokens(prompt))
                if out is not None:
                    results[name].append(out)
                if on_run is not None:
                    on_run(prompt, name)
        baseline = results["ar"][0][0]
        for name in names:
            if len(results[name]) == plan.repeats:    # an anchor that failed mid-prompt has fewer
                rows.append(_row(i, prompt, len(ids), name, results[name], baseline, plan.temperature))
    failed = {n for n, s in (plan.anchors.status.items() if plan.anchors else ()) if s["status"] != "ok"}
    return [r for r in rows if r["method"] not in failed]   # a partial anchor would skew its medians


def _guarded(plan: Plan, name: str, ids: list[int], max_new_tokens: int):
    """Our methods raise; an anchor that raises is recorded, disabled, and returns None."""
    if name in plan.our_names:
        return plan.run_once(name, ids, max_new_tokens)
    if name not in plan.anchors.names:
        return None
    try:
        return plan.run_once(name, ids, max_new_tokens)
    except Exception as e:  # noqa: BLE001 - an anchor never stops the benchmark
        plan.anchors.fail(name, e)
        return None


def _row(index: int, prompt: Prompt, prompt_tokens: int, name: str, results: list, baseline: list[int],
         temperature: float) -> dict:
    tok_s = [s["tokens_per_s"] for _, s in results]
    # the median run (the lower middle one for an even count): its stats are a real run's, not a blend
    median_run = sorted(range(len(results)), key=lambda j: tok_s[j])[(len(results) - 1) // 2]
    tokens, stats = results[median_run]
    return {"prompt_index": index, "prompt": prompt.id, "category": prompt.category, "method": name,
            "kind": "anchor" if name in ANCHOR_NAMES else "ours", "prompt_tokens": prompt_tokens,
            "tokens_per_s": tok_s[median_run], "tokens_per_s_repeats": tok_s,
            # llama.cpp runs its own kernels on its own weight format: its tokens are no test of exactness
            "exact": all(t == baseline for t, _ in results) if temperature == 0 and name not in LLAMA_CPP_ANCHORS
            else None,
            "output": tokens, "stats": stats}


# --------------------------------------------------------------------------- summary
def summarize(rows: list[dict]) -> dict:
    """{category: {method: entry}}, category "all" first; see the module docstring for the statistics."""
    categories = ["all"] + list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    # keyed by position, not id: a user's prompt file may repeat ids
    ar = {r["prompt_index"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    ar_decode = {r["prompt_index"]: decode_rate(r["stats"]) for r in rows if r["method"] == "ar"}
    summary: dict = {}
    for cat in categories:
        summary[cat] = {}
        for m in methods:
            sel = [r for r in rows if r["method"] == m and cat in ("all", r["category"])]
            if sel:
                summary[cat][m] = _entry(sel, ar, ar_decode)
    return summary


def decode_rate(stats: dict) -> float | None:
    """Tokens per second after the target's prefill (its first token excluded): what the step
    policy decides; None when the run does not report its prefill (anchors)."""
    seconds = stats.get("seconds", 0.0) - stats.get("prefill_seconds", stats.get("seconds", 0.0))
    return (stats["tokens"] - 1) / seconds if seconds > 0 and stats.get("tokens", 0) > 1 else None


def _entry(rows: list[dict], ar_tok_s: dict, ar_decode: dict) -> dict:
    stats = [r["stats"] for r in rows]
    ratios = [r["tokens_per_s"] / ar_tok_s[r["prompt_index"]] for r in rows if ar_tok_s.get(r["prompt_index"])]
    decode_ratios = [decode_rate(r["stats"]) / ar_decode[r["prompt_index"]] for r in rows
                     if decode_rate(r["stats"]) and ar_decode.get(r["prompt_index"])]
    exact = [r["exact"] for r in rows if r["exact"] is not None]
    entry = {"kind": rows[0]["kind"], "prompts": len(rows),
             "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
             "speedup": statistics.median(ratios) if ratios else None,
             # the same after the prefill (the drafter's pass over the prompt is in its first step)
             "decode_speedup": statistics.median(decode_ratios) if decode_ratios else None,
             # time to first token (the target's prefill, the sources' warm-up, the first token)
             "first_token_s": statistics.median(ts) if (ts := [s["prefill_seconds"] for s in stats
                                                                if "prefill_seconds" in s]) else None,
             "exact": {"compared": len(exact), "mismatches": exact.count(False)} if exact else None,
             "mat": None, "drafter_forwards_per_step": None, "accepted_per_step": None,
             "accepted_per_step_by_source_depth": None, "expected_per_step_by_source_depth": None,
             "expected_accepted_per_step": None, "time_split": None}
    if rows[0]["kind"] == "anchor":
        return entry     # HF generate reports none of the counts below
    steps = sum(s.get("steps", 0) for s in stats)
    seconds = sum(s["seconds"] for s in stats)
    if steps:
        entry["mat"] = sum(s.get("mat", 0.0) * s.get("steps", 0) for s in stats) / steps
        entry["drafter_forwards_per_step"] = sum(
            s.get("drafter_forwards_per_step", 0.0) * s.get("steps", 0) for s in stats) / steps
        if any("accepted_by_source" in s for s in stats):    # ar has no tree, so no key
            accepted: dict[str, int] = {}
            for s in stats:
                for src, n in s.get("accepted_by_source", {}).items():
                    accepted[src] = accepted.get(src, 0) + n
            entry["accepted_per_step"] = {src: n / steps for src, n in accepted.items()}
            entry["accepted_per_step_by_source_depth"] = _per_step_by_source_depth(stats, "accepted_by_source_depth",
                                                                                   steps)
            entry["expected_per_step_by_source_depth"] = _per_step_by_source_depth(
                stats, "expected_accepted_by_source_depth", steps)
            expected: dict[str, float] = {}
            for s in stats:
                for src, x in s.get("expected_accepted_by_source", {}).items():
                    expected[src] = expected.get(src, 0.0) + x
            entry["expected_accepted_per_step"] = {src: x / steps for src, x in expected.items()}
    if seconds > 0 and any("time_split" in s for s in stats):
        split = {ph: sum(s.get("time_split", {}).get(ph, 0.0) for s in stats) / seconds for ph in PHASES[1:]}
        entry["time_split"] = {"prefill": sum(s.get("prefill_seconds", 0.0) for s in stats) / seconds, **split}
    return entry


def _per_step_by_source_depth(stats: list[dict], key: str, steps: int) -> dict[str, dict[int, float]]:
    """``key``'s {source: {depth: count}} summed over runs, per step."""
    total: dict[str, dict[int, float]] = {}
    for s in stats:
        for src, depths in s.get(key, {}).items():
            for d, n in depths.items():
                total.setdefault(src, {})[int(d)] = total.get(src, {}).get(int(d), 0) + n
    return {src: {d: n / steps for d, n in sorted(depths.items())} for src, depths in total.items()}


# --------------------------------------------------------------------------- table
def markdown_table(summary: dict, temperature: float = 0.0) -> str:
    """One markdown table: overall rows first, then one block per category when there are several."""
    categories = list(summary) if len(summary) > 2 else ["all"]   # one category: "all" says it all
    header = ("| category | method | prompts | tok/s | speedup vs ar | after prefill | first token s | MAT "
              "| drafter fwd/step "
              "| accepted/step by source | time % prefill/draft/retrieve/verify/commit | exact vs ar |")
    lines = [header, "|" + "---|" * (header.count(" | ") + 1)]
    for cat in categories:
        for m, e in summary[cat].items():
            lines.append(f"| {cat} | {m} | {e['prompts']} | {e['tokens_per_s']:.2f} | {_fmt(e['speedup'], 'x')} "
                         f"| {_fmt(e['decode_speedup'], 'x')} | {_fmt(e.get('first_token_s'))} | {_fmt(e['mat'])} "
                         f"| {_fmt(e['drafter_forwards_per_step'])} "
                         f"| {_fmt_sources(e['accepted_per_step'])} | {_fmt_split(e['time_split'])} "
                         f"| {_fmt_exact(e['exact'], temperature)} |")
    return "\n".join(lines)


def acceptance_table(summary: dict) -> str:
    """Estimate vs observed, per method and source (all prompts): the accepted nodes per step the
    acceptance estimates predicted for the trees verified (before each step's outcome), and the
    accepted nodes per step counted; then both per tree depth (depths where both are under 0.005
    left out)."""
    lines = ["| method | source | expected accepted/step | observed accepted/step | observed / expected "
             "| observed / expected by tree depth |", "|---|---|---|---|---|---|"]
    for m, e in summary["all"].items():
        expected, observed = e.get("expected_accepted_per_step") or {}, e.get("accepted_per_step") or {}
        obs_depth = e.get("accepted_per_step_by_source_depth") or {}
        exp_depth = e.get("expected_per_step_by_source_depth") or {}
        for src in sorted(expected):
            obs = observed.get(src, 0.0)
            ratio = f"{obs / expected[src]:.2f}" if expected[src] > 0 else "n.a."
            o, x = obs_depth.get(src, {}), exp_depth.get(src, {})
            depths = ", ".join(f"{d}: {o.get(d, 0.0):.2f}/{x.get(d, 0.0):.2f}" for d in sorted(set(o) | set(x))
                               if max(o.get(d, 0.0), x.get(d, 0.0)) >= 0.005) or "none"
            lines.append(f"| {m} | {src} | {expected[src]:.3f} | {obs:.3f} | {ratio} | {depths} |")
    return "\n".join(lines)


def _fmt(x, suffix: str = "") -> str:
    return "n.a." if x is None else f"{x:.2f}{suffix}"


def _fmt_sources(acc: dict | None) -> str:
    if acc is None:
        return "n.a."
    return ", ".join(f"{src} {n:.2f}" for src, n in sorted(acc.items())) or "none accepted"


def _fmt_split(split: dict | None) -> str:
    return "n.a." if split is None else "/".join(f"{100 * split[ph]:.0f}" for ph in PHASES)


def _fmt_exact(exact: dict | None, temperature: float) -> str:
    if exact is None:
        return "n.a. (sampling)" if temperature > 0 else "n.a."
    ok = exact["compared"] - exact["mismatches"]
    mark = "" if exact["mismatches"] == 0 else f" **{exact['mismatches']} MISMATCH**"
    return f"{ok}/{exact['compared']}{mark}"


# --------------------------------------------------------------------------- report
def machine_info() -> dict:
    """Where and with what the numbers were measured."""
    info = {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "graft_tk": __version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for pkg in ("transformers", "triton"):
        try:
            info[pkg] = __import__(pkg).__version__
        except ImportError:
            info[pkg] = None
    return info


def build_report(plan: Plan, rows: list[dict], args: dict | None = None) -> dict:
    """The JSON document: machine, config, prompts, anchors' status, every run and the summary."""
    return {
        "tool": "graft-bench",
        "machine": machine_info(),
        "config": {"target": plan.target.name, "drafter": plan.drafter.name if plan.drafter else None,
                   "dtype": str(plan.target.dtype).removeprefix("torch."), "device": str(plan.target.device),
                   "quant": plan.target.quant, "drafter_quant": getattr(plan.drafter, "quant", None),
                   "methods": list(plan.methods), "max_new_tokens": plan.max_new_tokens,
                   "temperature": plan.temperature, "top_p": plan.top_p, "seed": plan.seed, "repeats": plan.repeats,
                   "compile": [c.value for c in plan.compile], "exact": plan.exact, "adaptive": list(plan.adaptive),
                   "graft": asdict(plan.config),
                   "args": args or {}},
        "warmup_seconds": plan.warmup_seconds,
        "prompts": [{"id": p.id, "category": p.category} for p in plan.prompts],
        "anchors": plan.anchors.status if plan.anchors else {},
        "runs": rows,
        "summary": summarize(rows),
    }


def write_json(path, report: dict) -> None:
    atomic_write_text(path, json.dumps(report, indent=1, default=str) + "\n")
