"""Print the baselines table: ``python -m bundles.gridsim.baselines [--split eval]``.

For every task of the split it grades two schedules with the bundle's own loader and scores:
idling all day and the greedy rule (``greedy.py``). Per battery size, then over all days, it
prints the number of days, the mean optimum profit, and each policy's mean grade with its
standard error (sample standard deviation / sqrt(n)), as the Markdown table the README
carries. Exits 1 if the bundle does not load or the greedy rule ever produces an invalid
schedule (a bug in the rule).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.envs.bundle import BundleError, load_bundle

from .greedy import greedy_schedule
from .market import Battery, scores


@dataclass(frozen=True)
class Row:
    """One battery size's results, or all days' (``capacity_mwh`` None); grades are means."""

    capacity_mwh: int | None
    days: int
    optimum_profit: float
    idle: tuple[float, float]  # mean, standard error
    greedy: tuple[float, float]
    greedy_ratio: float


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for fewer than two values)."""
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, se


def baseline_scores(data: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """The scores (``market.scores``) of idling all day and of the greedy rule's schedule on a
    task's ``data``; KeyError / ValueError for data that is not a gridsim day."""
    prices, battery = data["prices"], Battery.from_data(dict(data))
    idle = scores(prices, [0] * len(prices), battery)
    return idle, scores(prices, greedy_schedule(prices, battery), battery)


def baseline_rows(bundle_dir: Path, split: str) -> list[Row]:
    """One row per battery size, then one for all days; ValueError if greedy made an invalid
    schedule (a bug in the rule)."""
    bundle = load_bundle(bundle_dir)
    by_size: dict[int, list[dict[str, float]]] = defaultdict(list)
    for task in bundle.tasks(split):
        idle, greedy = baseline_scores(task.data)
        if not greedy["valid"]:
            raise ValueError(f"greedy rule made an invalid schedule for {task.id}")
        by_size[task.data["battery"]["capacity_mwh"]].append(
            {
                "optimum": greedy["optimum_profit"],
                "idle": idle["grade"],
                "greedy": greedy["grade"],
                "ratio": greedy["ratio"],
            }
        )
    groups: list[tuple[int | None, list[dict[str, float]]]] = sorted(by_size.items())
    groups.append((None, [d for days in by_size.values() for d in days]))
    return [
        Row(
            capacity_mwh=size,
            days=len(days),
            optimum_profit=statistics.fmean(d["optimum"] for d in days),
            idle=mean_se([d["idle"] for d in days]),
            greedy=mean_se([d["greedy"] for d in days]),
            greedy_ratio=statistics.fmean(d["ratio"] for d in days),
        )
        for size, days in groups
    ]


def render(rows: Sequence[Row]) -> str:
    """The Markdown table."""
    lines = [
        "| storage | days | mean optimum profit (EUR) | idle grade | greedy grade "
        "| greedy profit / optimum |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = "all" if r.capacity_mwh is None else f"{r.capacity_mwh} MWh ({r.capacity_mwh} h)"
        lines.append(
            f"| {size} | {r.days} | {r.optimum_profit:.2f} "
            f"| {r.idle[0]:.3f} ± {r.idle[1]:.3f} | {r.greedy[0]:.3f} ± {r.greedy[1]:.3f} "
            f"| {r.greedy_ratio:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print gridsim's idle and greedy baselines.")
    parser.add_argument("--split", default="eval")
    parser.add_argument("--bundle", type=Path, default=Path(__file__).parent)
    args = parser.parse_args(argv)
    try:
        rows = baseline_rows(args.bundle, args.split)
    except (BundleError, ValueError) as exc:
        print(f"error: {exc}")
        return 1
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
