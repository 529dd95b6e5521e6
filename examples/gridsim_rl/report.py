"""Stage 5: the results table, the curves and the final model.

- :func:`baselines`: the idle and greedy policies graded offline with the bundle's scores on the
  eval days (``bundles/gridsim/baselines.py``'s arithmetic), per battery size and overall.
- :func:`eval_summaries`: the RL run's evaluations (``<rl>/evals/step-N/summary.json``, written
  by corral's eval at temperature 0 on the eval rows); step 0 is the SFT model.
- :func:`write_report`: ``results.json`` and ``results.md`` (mean grade ± standard error per
  battery size and overall, the share graded 0, failed episodes) for idle, greedy, the SFT
  start and the model after RL, plus ``curves.png`` (corral's ``plot_run``) and
  ``reward.png`` (eval grade per step against the baselines).
- :func:`export_final_model`: the RL run's last checkpoint as a Hugging Face folder in bfloat16.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from .days import gridsim

SIZES = ("1", "2", "4")


def _stats(grades: list[float]) -> dict[str, Any]:
    from bundles.gridsim.baselines import mean_se

    mean, se = mean_se(grades)
    return {
        "episodes": len(grades),
        "graded": len(grades),
        "failed": 0,
        "mean": mean,
        "se": se if len(grades) > 1 else None,  # as corral's eval summaries
        "zero_share": sum(g == 0.0 for g in grades) / len(grades),
    }


class BaselineDay(NamedTuple):
    """One eval day graded offline with the bundle's scores: the idle and greedy policies."""

    task_id: str
    size: str  # the battery's capacity, MWh
    idle: float
    greedy: float


def baseline_days(limit: int | None = None) -> list[BaselineDay]:
    """The first ``limit`` eval days (all: None), each with the idle and greedy grades."""
    from bundles.gridsim.baselines import baseline_scores

    days = []
    for task in gridsim().tasks("eval")[:limit]:
        idle, greedy = baseline_scores(task.data)
        size = str(task.data["battery"]["capacity_mwh"])
        days.append(BaselineDay(task.id, size, idle["grade"], greedy["grade"]))
    return days


def baselines(days: list[BaselineDay]) -> dict[str, dict[str, Any]]:
    """``{"idle": ..., "greedy": ...}`` over ``days``, each ``{"overall": stats, "groups":
    {size: stats}}`` in the shape of corral's eval summaries."""
    by: dict[str, dict[str, list[float]]] = {"idle": defaultdict(list), "greedy": defaultdict(list)}
    for day in days:
        by["idle"][day.size].append(day.idle)
        by["greedy"][day.size].append(day.greedy)
    return {
        name: {
            "overall": _stats([g for v in groups.values() for g in v]),
            "groups": {size: _stats(v) for size, v in sorted(groups.items())},
        }
        for name, groups in by.items()
    }


def paired_differences(
    rl_dir: Path, first: int, last: int, days: list[BaselineDay]
) -> dict[str, dict[str, Any]]:
    """Per-day grade differences on the same eval days (the noise between days cancels):
    after RL minus the SFT start, after RL minus the greedy rule, the SFT start minus the
    greedy rule (its grades from ``days``); each with its mean, standard error and how many
    days were better, equal (within 1e-9) or worse. Empty when an evaluation kept no
    episodes."""

    def grades(step: int) -> dict[str, float]:
        path = rl_dir / "evals" / f"step-{step:06d}" / "episodes.jsonl"
        if not path.is_file():
            return {}
        episodes = [json.loads(line) for line in path.read_text().splitlines() if line]
        return {e["task_id"]: float(e["reward"] or 0.0) for e in episodes}

    start, end = grades(first), grades(last)
    greedy = {day.task_id: day.greedy for day in days}
    pairs = {
        "after RL - SFT start": (end, start),
        "after RL - greedy rule": (end, greedy),
        "SFT start - greedy rule": (start, greedy),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, (a, b) in pairs.items():
        shared = sorted(set(a) & set(b))
        if not shared:
            continue
        diffs = [a[d] - b[d] for d in shared]
        out[name] = {
            **_stats(diffs),
            "better": sum(x > 1e-9 for x in diffs),
            "equal": sum(abs(x) <= 1e-9 for x in diffs),
            "worse": sum(x < -1e-9 for x in diffs),
        }
    return out


def render_paired(paired: dict[str, dict[str, Any]]) -> str:
    rows = "\n".join(
        f"| {name} | {s['mean']:+.4f} ± {s['se'] or 0.0:.4f} | {s['better']} | {s['equal']} | "
        f"{s['worse']} |"
        for name, s in paired.items()
    )
    return (
        f"| difference | mean ± se | days better | equal | worse |\n|---|---|---|---|---|\n{rows}"
    )


def eval_summaries(rl_dir: Path) -> dict[int, dict[str, Any]]:
    """Every evaluation of the RL run: step -> its ``summary.json``."""
    out = {}
    for path in sorted((rl_dir / "evals").glob("step-*/summary.json")):
        out[int(path.parent.name.removeprefix("step-"))] = json.loads(path.read_text())
    return out


def _cell(stats: dict[str, Any] | None) -> str:
    if not stats or stats.get("mean") is None:
        return "-"
    se = stats.get("se")
    return f"{stats['mean']:.3f} ± {se:.3f}" if se is not None else f"{stats['mean']:.3f}"


def _share(stats: dict[str, Any]) -> str:
    share = stats.get("zero_share")
    return "-" if share is None else f"{share:.1%}"


def render_table(policies: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of ``{label: summary}``."""
    lines = [
        "| policy | 1 MWh | 2 MWh | 4 MWh | all | graded 0 | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, summary in policies.items():
        groups = summary.get("groups", {})
        overall = summary["overall"]
        cells = [_cell(groups.get(size)) for size in SIZES]
        lines.append(
            f"| {label} | {' | '.join(cells)} | {_cell(overall)} | {_share(overall)} "
            f"| {overall.get('failed', 0)} |"
        )
    return "\n".join(lines)


def write_report(out: Path, rl_dir: Path, facts: dict[str, Any]) -> dict[str, Any]:
    """Write ``results.json``, ``results.md``, ``curves.png`` and ``reward.png`` into ``out``
    and return the results. ``facts`` (data counts, model size, timings) go into both files.
    ValueError when the RL run has no evaluation."""
    evals = eval_summaries(rl_dir)
    if not evals:
        raise ValueError(f"{rl_dir} has no evaluation yet")
    episodes = evals[min(evals)]["overall"]["episodes"]
    days = baseline_days(limit=episodes)
    base = baselines(days)
    first, last = min(evals), max(evals)
    policies = {
        "idle": base["idle"],
        "greedy rule": base["greedy"],
        f"SFT start (step {first})": evals[first],
        f"after RL (step {last})": evals[last],
    }
    paired = paired_differences(rl_dir, first, last, days)
    results = {
        "eval_days": episodes,
        "policies": policies,
        "paired": paired,
        "evals": {str(step): summary for step, summary in sorted(evals.items())},
        "facts": facts,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    curve = "\n".join(
        f"| {step} | {_cell(s['overall'])} | "
        + " | ".join(_cell(s.get("groups", {}).get(size)) for size in SIZES)
        + f" | {_share(s['overall'])} |"
        for step, s in sorted(evals.items())
    )
    facts_lines = "\n".join(f"- {key}: {value}" for key, value in facts.items())
    (out / "results.md").write_text(
        f"# gridsim RL: results on {episodes} eval days\n\n"
        "Mean grade ± standard error of the mean (temperature 0, one episode per day).\n\n"
        f"{render_table(policies)}\n\n## Paired differences (the same days)\n\n"
        f"{render_paired(paired)}\n\n## Every evaluation\n\n"
        "| step | all | 1 MWh | 2 MWh | 4 MWh | graded 0 |\n|---|---|---|---|---|---|\n"
        f"{curve}\n\n## Run\n\n{facts_lines}\n"
    )
    _plots(out, rl_dir, evals, base)
    return results


def _plots(out: Path, rl_dir: Path, evals: dict[int, dict[str, Any]], base: dict[str, Any]) -> None:
    try:
        import matplotlib
    except ImportError:  # the train extra's; the tables above do not need it
        return
    from corral.trainer.plot import plot_run

    plot_run(rl_dir, out / "curves.png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(evals)
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    means = [evals[s]["overall"]["mean"] for s in steps]
    ses = [evals[s]["overall"]["se"] or 0.0 for s in steps]
    ax.errorbar(steps, means, yerr=ses, fmt="o-", color="black", capsize=3, label="model (all)")
    for size in SIZES:
        ys = [evals[s].get("groups", {}).get(size, {}).get("mean") for s in steps]
        if any(y is not None for y in ys):
            ax.plot(steps, ys, ".-", linewidth=0.8, alpha=0.7, label=f"model ({size} MWh)")
    for name, style in (("greedy", "--"), ("idle", ":")):
        ax.axhline(base[name]["overall"]["mean"], linestyle=style, color="gray", label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean eval grade")
    ax.set_title("gridsim eval grade (temperature 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(out / "reward.png", dpi=100)
    plt.close(fig)


def export_final_model(rl_dir: Path, start_model: Path, out: Path) -> Path:
    """The RL run's latest checkpoint (a megatron-core state dict) as a Hugging Face folder
    ``out`` in bfloat16, with ``start_model``'s config and tokenizer (``start_model`` itself
    when the run has no checkpoint); ``checkpoint.json`` names where the weights came from.
    ValueError when the checkpoint does not fit the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from corral.trainer.checkpoint import latest_checkpoint
    from corral.trainer.convert import megatron_to_hf
    from corral.trainer.model import ModelSpec

    checkpoint = latest_checkpoint(rl_dir)
    model = AutoModelForCausalLM.from_pretrained(str(start_model), dtype=torch.float32)
    if checkpoint is not None:  # None: an RL run of 0 steps (an evaluation of the start)
        state = torch.load(checkpoint / "model-rank0.pt", map_location="cpu", weights_only=True)
        spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(start_model)))
        result = model.load_state_dict(megatron_to_hf(state, spec), strict=False)
        missing = [k for k in result.missing_keys if k != "lm_head.weight"]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{checkpoint} does not fit {start_model}: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
        model.tie_weights()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(start_model)).save_pretrained(out)
    origin = {"from": str(checkpoint), "step": _step(checkpoint)} if checkpoint else None
    origin = origin or {"from": str(start_model), "step": 0}
    (out / "checkpoint.json").write_text(json.dumps(origin, indent=2) + "\n")
    return out


def _step(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "state.json").read_text())["step"])
