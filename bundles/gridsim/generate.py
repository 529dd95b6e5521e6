"""Write gridsim's task files: ``python -m bundles.gridsim.generate`` (from the repository root).

Every task is a pure function of ``(seed, split, index)``: its RNG is seeded from a SHA-256 of
those three, so one task can be regenerated without the others and the files are byte-for-byte
reproducible. Splits: ``train`` is 2,000 consecutive days from 2019-07-01; ``eval`` is 200 days
spread evenly over 2025 (a later year, every season). Battery sizes cycle with the index
(1, 2, 4 MWh of storage at 1 MW), so each size holds a third of every split.

Usage: ``python -m bundles.gridsim.generate [--out DIR] [--seed N]`` (defaults: this bundle's
``tasks/`` folder, seed 20250101). Exits non-zero only if the folder cannot be written.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .market import Battery
from .prices import day_prices

DEFAULT_SEED = 20250101
CAPACITIES_MWH = (1, 2, 4)
POWER_MW = 1
EFFICIENCY = 0.85


@dataclass(frozen=True)
class SplitPlan:
    """How many days a split holds and which calendar day its ``index`` falls on."""

    count: int
    first: dt.date
    span_days: int  # days the split's dates are spread over (== count: consecutive)

    def date(self, index: int) -> dt.date:
        return self.first + dt.timedelta(days=index * self.span_days // self.count)


SPLITS = {
    "train": SplitPlan(2000, dt.date(2019, 7, 1), 2000),
    "eval": SplitPlan(200, dt.date(2025, 1, 1), 365),
}


def task_rng(seed: int, split: str, index: int) -> random.Random:
    """The task's own RNG (a hash, not ``hash()``, so it is the same in every process)."""
    digest = hashlib.sha256(f"gridsim:{seed}:{split}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def day_battery(index: int) -> Battery:
    """The battery of a split's day ``index``: the sizes cycle with the index, starting empty."""
    return Battery(
        capacity_mwh=CAPACITIES_MWH[index % len(CAPACITIES_MWH)],
        power_mw=POWER_MW,
        efficiency=EFFICIENCY,
        initial_soc_mwh=0,
    )


def make_task(split: str, index: int, seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """One task line (``id``, ``prompt``, ``data``); KeyError for an unknown split."""
    date = SPLITS[split].date(index)
    battery = day_battery(index)
    prices = day_prices(task_rng(seed, split, index), date)
    return {
        "id": f"{split}-{index:04d}",
        "prompt": render_prompt(date, battery, prices),
        "data": task_data(date, battery, prices),
    }


def task_data(date: dt.date, battery: Battery, prices: list[float]) -> dict[str, Any]:
    """A task's ``data``: what the env and the verifier read (the day, the battery, prices)."""
    return {
        "date": date.isoformat(),
        "battery": {
            "capacity_mwh": battery.capacity_mwh,
            "power_mw": battery.power_mw,
            "efficiency": battery.efficiency,
            "initial_soc_mwh": battery.initial_soc_mwh,
        },
        "prices": prices,
    }


def render_prompt(date: dt.date, battery: Battery, prices: list[float]) -> str:
    """The user message: the battery, the day's prices, what to submit."""
    hours = battery.capacity_mwh // battery.power_mw
    table = "\n".join(f"{hour:02d}:00 {price:.2f}" for hour, price in enumerate(prices))
    return (
        f"Battery: {battery.capacity_mwh} MWh of storage, {battery.power_mw} MW of power "
        f"({hours} h at full power), round-trip efficiency {battery.efficiency:.0%}, "
        f"starts at {battery.initial_soc_mwh} MWh.\n"
        f"Day-ahead prices for {date:%A %Y-%m-%d}, EUR/MWh:\n{table}\n"
        "Submit your schedule with submit_schedule: 24 integers, one per hour from 00:00, "
        "1 = charge, -1 = sell, 0 = idle."
    )


def task_line(task: dict[str, Any]) -> str:
    """The task as its JSONL line (compact, key order fixed: the files must be reproducible)."""
    return json.dumps(task, separators=(",", ":"), ensure_ascii=False)


def write_split(out: Path, split: str, seed: int) -> Path:
    """Write ``out/<split>.jsonl``; returns its path."""
    path = out / f"{split}.jsonl"
    lines = (task_line(make_task(split, i, seed)) for i in range(SPLITS[split].count))
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write gridsim's tasks/<split>.jsonl files.")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "tasks")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        path = write_split(args.out, split, args.seed)
        print(f"wrote {path} ({SPLITS[split].count} tasks, {path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
