"""The Optuna search behind ``graft-calibrate``: measured decoding on this machine as the objective.

One trial = one GraftConfig (and method, when more than one is searched), scored by decoding the
tuning prompts for real:

- **Exact or discarded.** Every prompt's greedy output must equal plain ``ar`` decoding; a trial
  that differs fails (state FAIL, reason in its ``failure`` attribute) and can never be chosen.
- **Timed like graft-bench.** Fresh Engine per prompt (cold adjacency matrix), one untimed
  warm-up decode per trial, tokens/s = median over prompts (prefill included). MAT is pooled.
- **Seeded TPE**, resumable: the study lives in Optuna storage (SQLite under GRAFT_TK_HOME by
  default) and a rerun with the same name continues it. A fresh study first tries the default
  config, then the warm-start tau (see warm_start.py), so the report can say how much was gained.
- **Single objective** (tokens/s) prunes hopeless trials after each prompt (median pruner);
  **multi-objective** (tokens/s and MAT) reports the Pareto front instead.
"""
from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import optuna

from graft_tk._fs import graft_home
from graft_tk._version import __version__
from graft_tk.acceptance import AcceptancePriors
from graft_tk.batch import decode_batch
from graft_tk.bench.prompts import Prompt
from graft_tk.config import GraftConfig
from graft_tk.decode import decode, encode_prompt
from graft_tk.engine import Engine
from graft_tk.errors import InputError
from graft_tk.methods import METHODS
from graft_tk.models import Model
from graft_tk.models.eagle3 import Eagle3Head
from graft_tk.profiles import profile_key
from graft_tk.sampling import Sampling

from .warm_start import TAU_RANGE, WarmStart, suggest_tau

WARMUP_TOKENS = 8
OBJECTIVES = {"speed": ("tokens_per_s",), "speed,mat": ("tokens_per_s", "mat")}

# Retrieval templates: Token Recycling's 80-node tree and smaller ones of the same shape. Levels
# are cut to what k columns can feed (level d has at most k x level d-1 nodes).
TEMPLATES = {"tr80": (8, 21, 25, 15, 8, 3), "tr40": (4, 10, 12, 8, 4, 2), "tr20": (2, 5, 6, 4, 2, 1),
             "chain6": (1, 1, 1, 1, 1, 1)}


def fit_template(levels: tuple[int, ...], k: int) -> tuple[int, ...]:
    out, prev = [], 1
    for size in levels:
        size = min(size, prev * k)
        out.append(size)
        prev = size
    return tuple(out)


# --------------------------------------------------------------------------- search space
def suggest(trial: optuna.Trial, methods: tuple[str, ...], base: GraftConfig | None = None) -> tuple[str, GraftConfig]:
    """The search space: method (when several), tau, N, K, D, retrieval k and template; with a
    ``base`` config (a batch size's calibration), tau, N and D only (D from 0, no drafting, up to
    the base's), the rest kept from it."""
    method = trial.suggest_categorical("method", list(methods)) if len(methods) > 1 else methods[0]
    if base is not None:
        return method, dataclasses.replace(base, cost=None, tau=trial.suggest_float("tau", *TAU_RANGE, log=True),
                                           budget=trial.suggest_int("budget", 1, 32, log=True),
                                           max_depth=trial.suggest_int("max_depth", 0, base.max_depth))
    k = trial.suggest_int("retrieval_k", 2, 8)
    template = fit_template(TEMPLATES[trial.suggest_categorical("template", list(TEMPLATES))], k)
    config = GraftConfig(
        tau=trial.suggest_float("tau", *TAU_RANGE, log=True),
        budget=trial.suggest_int("budget", 4, 48, log=True),
        top_k=trial.suggest_int("top_k", 1, 8),
        max_depth=trial.suggest_int("max_depth", 1, 10),
        retrieval_k=k, template=template)
    return method, config


def params_of(method: str, config: GraftConfig, methods: tuple[str, ...], batched: bool = False) -> dict:
    """Trial parameters that reproduce ``config`` (to enqueue the default or warm-start trial);
    ``batched``: of ``suggest``'s space with a base config (tau, N and D)."""
    template = next((n for n, lv in TEMPLATES.items() if fit_template(lv, config.retrieval_k) == config.template),
                    "tr80")
    params = ({"tau": config.tau, "budget": config.budget, "max_depth": config.max_depth} if batched else
              {"retrieval_k": config.retrieval_k, "template": template, "tau": config.tau,
               "budget": config.budget, "top_k": config.top_k, "max_depth": config.max_depth})
    if len(methods) > 1:
        params["method"] = method
    return params


def config_of(trial: optuna.trial.FrozenTrial) -> tuple[str, GraftConfig]:
    """(method, GraftConfig) of a finished trial, from its stored attributes."""
    cfg = dict(trial.user_attrs["config"])
    cfg["template"] = tuple(cfg["template"])
    return trial.user_attrs["method"], GraftConfig(**cfg)


# --------------------------------------------------------------------------- the run
@dataclass
class Task:
    """What one calibration measures: the model pair, the prompts, and how."""
    target: Model
    drafter: Model | Eagle3Head | None
    prompts: list[Prompt]           # tuning prompts
    validation: list[Prompt]        # held-out prompts: best vs default, after the search
    max_new_tokens: int
    methods: tuple[str, ...] = ("graft",)
    objectives: str = "speed"
    repeats: int = 1
    seed: int = 0
    temperature: float = 0.0        # > 0: trials sample (seeded); outputs are then not compared with ar's
    top_p: float = 1.0
    compile: bool = False           # compiled step forwards (each new budget N compiles a verify graph)
    # > 1: the prompts decode this many at a time (graft_tk.batch), scored by the batch's output
    # tokens/s; only tau, N and D are searched, the rest kept from ``base`` (the pair's profile)
    batch: int = 1
    base: GraftConfig | None = None

    def __post_init__(self):
        if self.objectives not in OBJECTIVES:
            raise InputError(f"--objectives must be one of {', '.join(OBJECTIVES)}, got {self.objectives!r}")
        if not self.prompts:
            raise InputError("no tuning prompts: raise --n-prompts or pass a prompt file with more rows")
        if self.max_new_tokens < WARMUP_TOKENS:
            raise InputError(f"--max-new-tokens must be >= {WARMUP_TOKENS}, got {self.max_new_tokens}")
        if self.repeats < 1:
            raise InputError(f"--repeats must be >= 1, got {self.repeats}")
        if self.batch < 1 or (self.batch > 1 and self.compile):
            raise InputError(f"--batch must be >= 1 and runs eagerly (no --compile), got {self.batch}")
        if self.drafter is None and any(METHODS[m].drafts for m in self.methods):
            raise InputError(f"method(s) {', '.join(m for m in self.methods if METHODS[m].drafts)} need a drafter; "
                             "pass --drafter NAME or self:L, or --methods retrieval,pld with --drafter none")

    def settings(self) -> dict:
        """What must match for a resumed study's trials to be comparable."""
        return {"prompts": [p.id for p in self.prompts], "max_new_tokens": self.max_new_tokens,
                "methods": list(self.methods), "objectives": self.objectives, "repeats": self.repeats,
                "temperature": self.temperature, "top_p": self.top_p, "graft_tk": __version__, "batch": self.batch}


def default_storage() -> str:
    path = graft_home() / "calibration" / "studies.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def default_study_name(target: Model, drafter: Model | Eagle3Head | None, objectives: str, batch: int = 1) -> str:
    key = profile_key(target, drafter)
    return (f"{key.target} + {key.drafter or 'none'} | {key.device} | {key.dtype} | {objectives}"
            + (f" | batch {batch}" if batch > 1 else ""))


def open_study(storage: str, name: str, task: Task) -> optuna.Study:
    """Create or resume the study; a resumed one must have been run with the same settings."""
    directions = ["maximize"] * len(OBJECTIVES[task.objectives])
    sampler = optuna.samplers.TPESampler(seed=task.seed, n_startup_trials=5, multivariate=True)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=0)
    try:
        study = optuna.create_study(storage=storage, study_name=name, directions=directions, sampler=sampler,
                                    pruner=pruner, load_if_exists=True)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy / driver errors come in many types
        raise InputError(f"cannot open Optuna storage {storage!r}: {type(e).__name__}: {e}. Pass --storage "
                         "sqlite:///PATH/studies.db (a writable folder) or a reachable database URL") from e
    if study.user_attrs.get("settings") is None:
        study.set_user_attr("settings", task.settings())
    elif study.user_attrs["settings"] != task.settings():
        old = study.user_attrs["settings"]
        diff = ", ".join(f"{k}: {old.get(k)!r} -> {v!r}" for k, v in task.settings().items() if old.get(k) != v)
        raise InputError(f"study {name!r} in {storage} was run with other settings ({diff}); its trials would not "
                         "be comparable. Rerun with the same settings, or pass --study-name NEW")
    # A resumed study draws fresh TPE samples rather than replaying the first run's seed.
    study.sampler = optuna.samplers.TPESampler(seed=task.seed + len(study.trials), n_startup_trials=5,
                                               multivariate=True)
    return study


class OutputMismatch(Exception):
    """A trial's greedy output differed from plain decoding: the trial fails and is never chosen."""


class Objective:
    """Decode the tuning prompts with a trial's config; return tokens/s (and MAT)."""

    def __init__(self, task: Task, encoded: list[list[int]], references: list[list[int]], ar_tok_s: list[float]):
        self.task, self.encoded, self.references, self.ar_tok_s = task, encoded, references, ar_tok_s

    def __call__(self, trial: optuna.Trial):
        task = self.task
        method, config = suggest(trial, task.methods, task.base if task.batch > 1 else None)
        trial.set_user_attr("method", method)
        trial.set_user_attr("config", dataclasses.asdict(config))
        run_decode(task, method, config, self.encoded[0], WARMUP_TOKENS)   # warm-up, untimed
        if task.batch > 1:   # one batched run over the prompts, scored by its output tokens/s
            outputs, speed, stats_all = run_batch(task, method, config, self.encoded)
            for j, tokens in enumerate(outputs):
                self._check(trial, j, tokens)
            return self._score(trial, [speed], [speed / self.ar_tok_s[0]], stats_all)
        tok_s, ratios, stats_all = [], [], []
        for j, ids in enumerate(self.encoded):
            runs = [run_decode(task, method, config, ids, task.max_new_tokens) for _ in range(task.repeats)]
            for tokens, _ in runs:
                self._check(trial, j, tokens)
            speeds = sorted(s["tokens_per_s"] for _, s in runs)
            tok_s.append(speeds[(len(speeds) - 1) // 2])
            ratios.append(tok_s[-1] / self.ar_tok_s[j])
            stats_all.append(runs[0][1])
            if len(OBJECTIVES[task.objectives]) == 1:
                trial.report(statistics.median(tok_s), j)
                if trial.should_prune():
                    trial.set_user_attr("tokens_per_s_partial", tok_s)
                    raise optuna.TrialPruned(f"median tokens/s {statistics.median(tok_s):.2f} after {j + 1} prompts")
        return self._score(trial, tok_s, ratios, stats_all)

    def _check(self, trial: optuna.Trial, j: int, tokens: list[int]) -> None:
        """Greedy output must be ar's: a trial that differs fails."""
        ref = self.references[j]
        if self.task.temperature == 0 and tokens != ref:
            at = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
            reason = f"output differs from ar on prompt {self.task.prompts[j].id} at new token {at}"
            trial.set_user_attr("failure", reason)
            raise OutputMismatch(reason)

    def _score(self, trial: optuna.Trial, tok_s: list[float], ratios: list[float], stats_all: list[dict]):
        task = self.task
        steps = sum(s["steps"] for s in stats_all)
        mat = sum(s["mat"] * s["steps"] for s in stats_all) / steps if steps else 1.0
        trial.set_user_attr("tokens_per_s_by_prompt", tok_s)
        trial.set_user_attr("speedup_vs_ar", statistics.median(ratios))
        trial.set_user_attr("mat", mat)
        trial.set_user_attr("drafter_forwards_per_step",
                            sum(s.get("drafter_forwards_per_step", 0) * s["steps"] for s in stats_all) / max(steps, 1))
        speed = statistics.median(tok_s)
        return (speed, mat) if len(OBJECTIVES[task.objectives]) == 2 else speed


def run_decode(task: Task, method: str, config: GraftConfig | None, ids: list[int], max_new_tokens: int):
    """One cold decode of the task's model pair (fresh Engine): (tokens, stats)."""
    r = decode(task.target, ids, method=method, drafter=task.drafter, config=config or GraftConfig(),
               max_new_tokens=max_new_tokens, temperature=task.temperature, top_p=task.top_p, seed=task.seed,
               compile=task.compile)
    return r.tokens, r.stats


def run_batch(task: Task, method: str, config: GraftConfig | None, encoded: list[list[int]]
              ) -> tuple[list[list[int]], float, list[dict]]:
    """The prompts decoded ``task.batch`` at a time with one cold Engine, cycled to twice the
    batch size so that the batch stays full: (each prompt's first output, the run's output
    tokens/s, every request's stats)."""
    engine = Engine(task.target, task.drafter if METHODS[method].drafts else None, config or GraftConfig())
    requests = [encoded[i % len(encoded)] for i in range(max(len(encoded), 2 * task.batch))]
    t = time.perf_counter()
    results = decode_batch(engine.batch(task.batch), requests, method, task.max_new_tokens,
                           Sampling(task.temperature, task.top_p, task.seed))
    seconds = time.perf_counter() - t
    tokens = sum(len(out) for out, _ in results)
    return [out for out, _ in results[:len(encoded)]], tokens / seconds, [stats for _, stats in results]


def reference_outputs(task: Task, prompts: list[Prompt]) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """(encoded prompts, ar outputs, ar tokens/s): the exactness bar and the speed baseline
    (batched: one figure, the batch's output tokens/s under ar)."""
    encoded = [encode_prompt(task.target, p.chat, chat=True) for p in prompts]
    context = task.target.config.max_position_embeddings
    for p, ids in zip(prompts, encoded):
        if len(ids) + task.max_new_tokens + 64 > context:
            raise InputError(f"prompt {p.id} ({len(ids)} tokens) + --max-new-tokens {task.max_new_tokens} does not fit "
                             f"{task.target.name}'s context of {context}; lower --max-new-tokens or use other prompts")
    run_decode(task, "ar", None, encoded[0], WARMUP_TOKENS)
    if task.batch > 1:
        refs, speed, _ = run_batch(task, "ar", None, encoded)
        return encoded, refs, [speed]
    refs, speeds = [], []
    for ids in encoded:
        tokens, stats = run_decode(task, "ar", None, ids, task.max_new_tokens)
        refs.append(tokens)
        speeds.append(stats["tokens_per_s"])
    return encoded, refs, speeds


def learn_priors(target: Model, drafter: Model | Eagle3Head | None, method: str, config: GraftConfig,
                 prompts: list[Prompt], max_new_tokens: int, compile: bool = False,
                 progress: Callable[[str], None] | None = None) -> AcceptancePriors:
    """The pair's acceptance priors: one engine decodes ``prompts`` with ``config`` fixed (without
    its cost model: full trees at the budget, so every source and score bucket gets tried, where
    the adaptive policy may never try one), counting every step undecayed, and returns what the
    counts support (``SpecState.learnt_priors``)."""
    config = dataclasses.replace(config, cost=None)
    engine = Engine(target, drafter if METHODS[method].drafts else None, config, compile=compile)
    engine.state.set_decay(1.0)
    for i, prompt in enumerate(prompts):
        if progress:
            progress(f"acceptance priors: prompt {i + 1}/{len(prompts)} ({prompt.id})")
        decode(target, encode_prompt(target, prompt.chat, chat=True), method=method, engine=engine,
               max_new_tokens=max_new_tokens)
    return engine.state.learnt_priors()


def warm_start(task: Task, encoded: list[list[int]], n_prompts: int = 2) -> WarmStart:
    """Log (drafter score, accepted?) with a full-depth drafter tree and with retrieval; fit tau."""
    log: list = []
    base = GraftConfig()
    for method in ("tree", "retrieval"):
        if METHODS[method].drafts and task.drafter is None:
            continue
        for ids in encoded[:n_prompts]:
            engine = Engine(task.target, task.drafter if METHODS[method].drafts else None, base,
                            compile=task.compile)
            engine.state.acceptance_log = log
            decode(task.target, ids, method=method, engine=engine, max_new_tokens=task.max_new_tokens)
    return suggest_tau(log, base.tau)


@dataclass
class Outcome:
    study: optuna.Study
    ar_tokens_per_s: float
    warm: WarmStart | None
    best: optuna.trial.FrozenTrial | None
    default: optuna.trial.FrozenTrial | None
    validation: dict | None = None


def calibrate(task: Task, study: optuna.Study, n_trials: int, timeout: float | None = None,
              on_trial: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None = None,
              log: Callable[[str], None] = print) -> Outcome:
    """Run ``n_trials`` more trials (or until ``timeout`` seconds) and return what was found."""
    log(f"measuring ar on {len(task.prompts)} tuning prompts ({task.max_new_tokens} new tokens each) ...")
    encoded, refs, ar_speeds = reference_outputs(task, task.prompts)
    ar_median = statistics.median(ar_speeds)
    log(f"ar: {ar_median:.2f} tok/s (median)")
    warm = None
    if not study.trials:
        default_method = "graft" if "graft" in task.methods else task.methods[0]
        batched = task.batch > 1
        study.enqueue_trial(params_of(default_method, task.base or GraftConfig(), task.methods, batched),
                            user_attrs={"origin": "default"})
        if batched:   # N = 1: no speculation at this batch size, what a busy server may do best
            off = dataclasses.replace(task.base or GraftConfig(), budget=1, max_depth=1)
            study.enqueue_trial(params_of(default_method, off, task.methods, batched),
                                user_attrs={"origin": "speculation off"})
            if any(METHODS[m].drafts for m in task.methods):   # D = 0: retrieval (and lookup) only, a small tree
                cheap = dataclasses.replace(task.base or GraftConfig(), budget=4, max_depth=0)
                study.enqueue_trial(params_of(default_method, cheap, task.methods, batched),
                                    user_attrs={"origin": "drafting off"})
        grafts = any(METHODS[m].drafts for m in task.methods) and any(METHODS[m].uses("adjacency") for m in task.methods)
        if grafts and not batched:
            warm = warm_start(task, encoded)
            log(warm.describe())
            study.enqueue_trial(params_of(default_method, dataclasses.replace(GraftConfig(), tau=warm.tau),
                                          task.methods), user_attrs={"origin": "warm-start"})
    objective = Objective(task, encoded, refs, ar_speeds)
    callbacks = [lambda s, t: on_trial(s, t)] if on_trial else []
    optuna.logging.set_verbosity(optuna.logging.ERROR)   # our progress bar and summary say it better
    study.optimize(objective, n_trials=n_trials, timeout=timeout, catch=(OutputMismatch,), callbacks=callbacks)
    return Outcome(study=study, ar_tokens_per_s=ar_median, warm=warm, best=best_trial(study),
                   default=next((t for t in completed(study) if t.user_attrs.get("origin") == "default"), None))


def completed(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The fastest complete trial (for multi-objective: the fastest on the Pareto front, the same thing)."""
    done = completed(study)
    return max(done, key=lambda t: t.values[0]) if done else None


def pareto_front(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """Trials no other trial beats on both tokens/s and MAT."""
    pts = [(t.values[0], t.user_attrs.get("mat", 0.0)) for t in trials]
    return [t for t, (s, m) in zip(trials, pts)
            if not any(s2 >= s and m2 >= m and (s2, m2) != (s, m) for s2, m2 in pts)]


def validate(task: Task, configs: dict[str, tuple[str, GraftConfig]], repeats: int = 1) -> dict:
    """Held-out check: each named config on the validation prompts, interleaved, medians, exactness vs ar."""
    encoded, refs, ar_speeds = reference_outputs(task, task.validation)
    names = list(configs)
    for name in names:
        run_decode(task, *configs[name], encoded[0], WARMUP_TOKENS)
    speeds: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    mismatches = {n: 0 for n in names}
    for j, ids in enumerate(encoded):
        order = names[j % len(names):] + names[:j % len(names)]
        per: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(repeats):
            for name in order:
                tokens, stats = run_decode(task, *configs[name], ids, task.max_new_tokens)
                mismatches[name] += task.temperature == 0 and tokens != refs[j]
                per[name].append(stats["tokens_per_s"])
        for name in names:
            s = sorted(per[name])[(len(per[name]) - 1) // 2]
            speeds[name].append(s)
            ratios[name].append(s / ar_speeds[j])
    return {"prompts": [p.id for p in task.validation], "ar_tokens_per_s": statistics.median(ar_speeds),
            "tokens_per_s": {n: statistics.median(v) for n, v in speeds.items()},
            "speedup_vs_ar": {n: statistics.median(v) for n, v in ratios.items()},
            "mismatches": mismatches,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
