"""``corral plot RUN``: the curves of a run's ``metrics.jsonl`` as one PNG.

Four panels over steps: rewards (train mean, eval mean with its standard error as a band, per
eval group as thin lines), the update (KL, entropy, clip fraction), the time split of a step
(generation, training, weight sync, stacked), and the groups the filter dropped, per reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corral.trainer.metrics import read_metrics, series

PNG = "curves.png"


def plot_run(run: Path, out: Path | None = None) -> Path:
    """Write the PNG of ``run`` (a run folder or its metrics file) to ``out`` (default
    ``<run>/curves.png``) and return its path. FileNotFoundError without a metrics file;
    ValueError when the file has no lines."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    lines = read_metrics(run)
    if not lines:
        raise ValueError(f"{run} has no metrics lines yet")
    folder = run if run.is_dir() else run.parent
    out = out or folder / PNG
    steps = [line for line in lines if line.get("kind") != "eval"]
    evals = [line for line in lines if line.get("kind") == "eval"]

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    ax = axes[0][0]
    _line(ax, steps, "reward/mean", "train reward (mean)", marker=".")
    means = list(series(evals, "eval/reward/mean"))
    if means:
        x = [s for s, _ in means]
        y = [v for _, v in means]
        se = dict(series(evals, "eval/reward/se"))
        ax.plot(x, y, "o-", label="eval reward (mean)", color="black")
        lo = [v - se.get(s, 0.0) for s, v in means]
        hi = [v + se.get(s, 0.0) for s, v in means]
        ax.fill_between(x, lo, hi, alpha=0.2, color="black", label="eval ± se")
        for key in sorted({k for line in evals for k in line if k.startswith("eval/group/")}):
            label = f"eval, group {key.removeprefix('eval/group/')}"
            _line(ax, evals, key, label, linewidth=0.8, alpha=0.6)
    if not list(series(steps, "reward/mean")):  # a supervised run: its loss instead
        _line(ax, steps, "loss", "train loss", marker=".")
        _line(ax, evals, "eval/loss", "eval loss", marker="o", color="black")
        _finish(ax, "loss", "cross entropy")
    else:
        _finish(ax, "reward", "reward")

    ax = axes[0][1]
    for key in ("kl", "entropy", "clip_fraction", "accuracy"):
        _line(ax, steps, key, key, marker=".")
    _finish(ax, "the update", "value")

    ax = axes[1][0]
    parts = ("time/generation", "time/training", "time/weight_sync")
    bottom: dict[int, float] = {}
    for key in parts:
        points = list(series(steps, key))
        if points:
            x = [s for s, _ in points]
            y = [v for _, v in points]
            ax.bar(x, y, bottom=[bottom.get(s, 0.0) for s in x], label=key.removeprefix("time/"))
            for s, v in points:
                bottom[s] = bottom.get(s, 0.0) + v
    _finish(ax, "time per step", "seconds")

    ax = axes[1][1]
    for key in sorted({k for line in steps for k in line if k.startswith("dropped/")}):
        _line(ax, steps, key, key.removeprefix("dropped/"), marker=".")
    _finish(ax, "groups dropped by the filter", "groups")

    fig.suptitle(str(folder))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _line(ax: Any, lines: list[dict[str, Any]], key: str, label: str, **style: Any) -> None:
    points = list(series(lines, key))
    if points:
        ax.plot([s for s, _ in points], [v for _, v in points], label=label, **style)


def _finish(ax: Any, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
