"""graft-bench's picture: tokens/s against MAT (the paper's Figure 1) and per-category speedups.

matplotlib is imported inside ``plot_summary`` so that importing graft_tk never pays for it, and
only the object-oriented ``Figure`` API is used (no pyplot): it renders with Agg whatever backend
the user's environment selects, and leaves no global figure state behind.
"""
from __future__ import annotations

import io
from pathlib import Path

from graft_tk._fs import atomic_write_bytes


def plot_summary(summary: dict, path: str | Path, title: str = "") -> None:
    """Write a two-panel PNG to ``path`` from ``bench.summarize``'s output.

    Left: tokens/s against MAT, one point per method (overall medians); HF anchors have no MAT
    and are drawn as dashed horizontal lines at their tokens/s. Right: speedup over ``ar`` per
    category, bars grouped by category, one colour per method, a line at 1x.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    overall = summary["all"]
    methods = list(overall)
    palette = colormaps["tab10" if len(methods) <= 10 else "tab20"]   # one colour per method
    colours = {m: palette(i % palette.N) for i, m in enumerate(methods)}
    fig = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=(1, 1.4))

    # A legend rather than text beside each point: methods often tie on MAT and speed.
    for m, e in overall.items():
        if e["mat"] is not None:
            left.scatter(e["mat"], e["tokens_per_s"], s=70, color=colours[m], zorder=3, label=m)
        else:
            left.axhline(e["tokens_per_s"], color=colours[m], linestyle="--", linewidth=1.2, label=f"{m} (no MAT)")
    mats = [e["mat"] for e in overall.values() if e["mat"] is not None]
    if mats:
        left.set_xlim(min(0.9, min(mats) - 0.1), max(mats) + 0.3)
    left.set_ylim(bottom=0)
    left.set_xlabel("MAT (tokens committed per target forward)")
    left.set_ylabel("tokens/s (median over prompts)")
    left.set_title("Speed against mean accepted length")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)

    categories = [c for c in summary if c != "all"]   # one category: its own name says more than "all"
    bar_methods = [m for m in methods if m != "ar"]
    width = 0.8 / max(len(bar_methods), 1)
    top = 1.0
    for j, m in enumerate(bar_methods):
        xs = [i + (j - (len(bar_methods) - 1) / 2) * width for i in range(len(categories))]
        ys = [(summary[c].get(m) or {}).get("speedup") or 0.0 for c in categories]
        hatch = "//" if overall[m]["kind"] == "anchor" else None
        bars = right.bar(xs, ys, width=width, color=colours[m], label=m, hatch=hatch, edgecolor="white",
                         linewidth=0.5)
        if len(categories) * len(bar_methods) <= 24:    # beyond that the labels collide
            right.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        top = max([top] + ys)
    right.axhline(1.0, color="black", linewidth=1, label="ar (1x)")
    right.set_ylim(0, top * 1.3)   # headroom for the bar labels and the legend above them
    right.set_xticks(range(len(categories)), categories, rotation=20 if len(categories) > 4 else 0)
    right.set_ylabel("speedup over ar (median over prompts)")
    right.set_title("Speedup by category")
    right.legend(fontsize=8, loc="upper center", ncols=min(len(bar_methods) + 1, 5))
    right.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(Path(path), buf.getvalue())


def plot_trace(per_step: dict[str, list[int]], labels: list[str], path: str | Path, title: str = "",
               window: int = 8) -> None:
    """Write what an adaptive engine chose, step by step, to ``path`` (PNG): tree nodes verified,
    drafter forwards and tokens committed per step (points; a line for the mean of the last
    ``window`` steps), the background shaded by ``labels`` (the workload of each step)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = (("nodes", "nodes verified"), ("drafter_forwards", "drafter forwards"), ("committed", "tokens committed"))
    fig = Figure(figsize=(12, 7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), 1, sharex=True)
    steps = list(range(len(labels)))
    spans, start = [], 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            spans.append((start, i, labels[start]))
            start = i
    names = list(dict.fromkeys(labels))
    for ax, (key, name) in zip(axes, rows):
        values = per_step[key]
        mean = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                for i in range(len(values))]
        for lo, hi, label in spans:
            ax.axvspan(lo - 0.5, hi - 0.5, color=f"C{names.index(label)}", alpha=0.12, lw=0)
        ax.plot(steps, values, ".", ms=3, color="0.35")
        ax.plot(steps, mean, "-", color="C3", lw=1.5, label=f"mean of {window} steps")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper right")
    for lo, hi, label in spans:
        if lo == 0 or labels[lo - 1] != label:
            axes[0].annotate(label, (lo, 1.0), xycoords=("data", "axes fraction"), va="bottom", fontsize=9)
    axes[-1].set_xlabel("step (the workloads' prompts one after another, one engine)")
    if title:
        fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())
