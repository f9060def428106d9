"""What graft-calibrate shows: the trials as a picture, and a short text summary."""
from __future__ import annotations

from pathlib import Path

import optuna

from graft_tk._fs import atomic_write_bytes

from .search import Outcome, completed, pareto_front

State = optuna.trial.TrialState


def plot_trials(study: optuna.Study, path: Path, title: str) -> Path:
    """PNG: tokens/s against MAT per complete trial, coloured by tau; Pareto front, default and best marked."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    done = completed(study)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    if done:
        mat = [t.user_attrs.get("mat", float("nan")) for t in done]
        speed = [t.values[0] for t in done]
        tau = [t.params.get("tau", 0.1) for t in done]
        sc = ax.scatter(mat, speed, c=tau, cmap="viridis", norm=LogNorm(vmin=min(tau), vmax=max(max(tau), min(tau) * 1.01)),
                        s=36, edgecolors="none", zorder=2)
        fig.colorbar(sc, ax=ax, label="tau (drafted path probability threshold)")
        front = sorted(pareto_front(done), key=lambda t: t.user_attrs.get("mat", 0.0))
        ax.plot([t.user_attrs.get("mat") for t in front], [t.values[0] for t in front], "-o", color="tab:red",
                mfc="none", ms=10, lw=1, label="Pareto front (tok/s, MAT)", zorder=3)
        best = max(done, key=lambda t: t.values[0])
        ax.scatter([best.user_attrs.get("mat")], [best.values[0]], marker="*", s=260, color="tab:red",
                   edgecolors="black", label=f"best: trial {best.number}", zorder=4)
        default = next((t for t in done if t.user_attrs.get("origin") == "default"), None)
        if default is not None:
            ax.scatter([default.user_attrs.get("mat")], [default.values[0]], marker="s", s=70, color="white",
                       edgecolors="black", label="default config", zorder=4)
        ax.legend(loc="lower right", fontsize=8)
    failed = sum(t.state == State.FAIL for t in study.trials)
    pruned = sum(t.state == State.PRUNED for t in study.trials)
    ax.set_xlabel("MAT (tokens per target forward)")
    ax.set_ylabel("tokens/s (median over tuning prompts)")
    ax.set_title(f"{title}\n{len(done)} complete, {pruned} pruned, {failed} failed (output != ar)", fontsize=9)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def describe_config(trial: optuna.trial.FrozenTrial) -> str:
    c = trial.user_attrs["config"]
    return (f"{trial.user_attrs['method']}: tau={c['tau']:.3g} N={c['budget']} K={c['top_k']} D={c['max_depth']} "
            f"k={c['retrieval_k']} template={tuple(c['template'])}")


def summary(outcome: Outcome, profile_path: Path | None, png: Path | None) -> str:
    """The text printed at the end of a run."""
    study = outcome.study
    done = completed(study)
    states = {s: sum(t.state == s for t in study.trials) for s in (State.COMPLETE, State.PRUNED, State.FAIL)}
    lines = [f"study {study.study_name!r}: {len(study.trials)} trials — {states[State.COMPLETE]} complete, "
             f"{states[State.PRUNED]} pruned, {states[State.FAIL]} failed"]
    for t in study.trials:
        if t.state == State.FAIL:
            lines.append(f"  trial {t.number} discarded: {t.user_attrs.get('failure', 'error (see log)')}")
    lines.append(f"ar on the tuning prompts: {outcome.ar_tokens_per_s:.2f} tok/s (this run)")
    if outcome.best is not None:
        b = outcome.best
        lines.append(f"best  (trial {b.number}): {b.values[0]:.2f} tok/s, {b.user_attrs['speedup_vs_ar']:.2f}x ar, "
                     f"MAT {b.user_attrs['mat']:.2f} — {describe_config(b)}")
    if outcome.default is not None:
        d = outcome.default
        lines.append(f"default (trial {d.number}): {d.values[0]:.2f} tok/s, {d.user_attrs['speedup_vs_ar']:.2f}x ar, "
                     f"MAT {d.user_attrs['mat']:.2f}")
    if len(study.directions) == 2 and done:
        front = sorted(pareto_front(done), key=lambda t: -t.values[0])
        lines.append("Pareto front (tok/s, MAT): " + ", ".join(
            f"#{t.number} ({t.values[0]:.2f}, {t.user_attrs['mat']:.2f})" for t in front))
    v = outcome.validation
    if v:
        lines.append(f"held-out check on {len(v['prompts'])} other prompts (ar {v['ar_tokens_per_s']:.2f} tok/s):")
        for name, s in v["tokens_per_s"].items():
            mism = v["mismatches"][name]
            lines.append(f"  {name:<8} {s:.2f} tok/s, {v['speedup_vs_ar'][name]:.2f}x ar"
                         + (f", {mism} output(s) != ar" if mism else ", outputs == ar"))
    if profile_path is not None:
        lines.append(f"profile: {profile_path}")
    if png is not None:
        lines.append(f"picture: {png}")
    if outcome.best is None:
        lines.append("no trial completed: no profile written" + ("" if not states[State.FAIL] else
                     " (every finished trial changed the output; calibrate in fp32 with --dtype fp32?)"))
    return "\n".join(lines)
