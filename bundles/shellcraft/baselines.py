"""Print the baselines table: ``python -m bundles.shellcraft.baselines [--split eval]``.

Plays every task of the split three times, in-process, each in a fresh temporary work folder:
idle (submit at once), the naive commands and the reference solver (``solver.py``'s
``naive_calls`` and ``reference``, the bundle's ``[[baselines]]`` and ``[solver]``), through the
bundle's own loader, env and verifier. Per family, then over all tasks, it prints the mean
reward of each policy (± the standard error of the mean) and the share of tasks each solved
exactly, as the Markdown table the README carries. Exits 1 if the bundle does not load.

In-process means no sandbox: the commands are the bundle's own, and run on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.envs.bundle import Bundle, BundleError, load_bundle
from corral.envs.episode import Task

from .files import FAMILIES
from .solver import SUBMIT, naive_calls, reference

# Policies of the solver shape: (task) -> [{"name", "arguments"}, ...].
Policy = Callable[[Task], list[dict[str, Any]]]
POLICIES: dict[str, Policy] = {
    "idle": lambda task: [{"name": SUBMIT, "arguments": {}}],
    "naive": naive_calls,
    "solver": reference,
}


@dataclass(frozen=True)
class Row:
    """One family's results, or all tasks' (``family`` None): per policy, (mean reward,
    standard error, share correct)."""

    family: str | None
    tasks: int
    results: dict[str, tuple[float, float, float]]


def play(bundle: Bundle, task: Task, calls: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """One episode in a fresh temporary work folder: the tool calls in order, until one ends
    it; the scores plus ``reward``."""
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):
        env = bundle.make_env()
        env.reset(bundle.env_task(task))
        for call in calls:
            if env.call_tool(call["name"], call["arguments"]).done:
                break
        scores = bundle.grade(task, env.state())
    return {**scores, "reward": bundle.reward(scores)}


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for fewer than two values)."""
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, se


def baseline_rows(bundle_dir: Path, split: str) -> list[Row]:
    """One row per family (in ``FAMILIES`` order), then one for all tasks."""
    bundle = load_bundle(bundle_dir)
    by_family: dict[str, list[dict[str, dict[str, float]]]] = defaultdict(list)
    for task in bundle.tasks(split):
        played = {name: play(bundle, task, policy(task)) for name, policy in POLICIES.items()}
        by_family[task.data["family"]].append(played)
    groups: list[tuple[str | None, list[dict[str, dict[str, float]]]]] = [
        (f, by_family[f]) for f in FAMILIES if by_family[f]
    ]
    groups.append((None, [p for f in FAMILIES for p in by_family[f]]))
    rows = []
    for family, episodes in groups:
        results = {}
        for name in POLICIES:
            mean, se = mean_se([e[name]["reward"] for e in episodes])
            results[name] = (mean, se, statistics.fmean(e[name]["correct"] for e in episodes))
        rows.append(Row(family, len(episodes), results))
    return rows


def render(rows: Sequence[Row]) -> str:
    """The Markdown table."""
    names = list(POLICIES)
    lines = [
        "| family | tasks | " + " | ".join(f"{n} reward (solved)" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for row in rows:
        cells = [
            f"{mean:.3f} ± {se:.3f} ({solved:.0%})"
            for mean, se, solved in (row.results[n] for n in names)
        ]
        lines.append(f"| {row.family or 'all'} | {row.tasks} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print shellcraft's idle/naive/solver baselines.")
    parser.add_argument("--split", default="eval")
    parser.add_argument("--bundle", type=Path, default=Path(__file__).parent)
    args = parser.parse_args(argv)
    try:
        rows = baseline_rows(args.bundle, args.split)
    except BundleError as exc:
        print(f"error: {exc}")
        return 1
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
