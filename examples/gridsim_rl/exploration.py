"""How often does sampling reach a schedule better than the greedy rule's? A CPU diagnostic.

Run: ``python examples/gridsim_rl/exploration.py [--model DIR] [--days 48] [--samples 16]
[--temperature 1.0 1.5 2.0]``.

The model (default: the committed policy, ``model/``) plays the first ``days`` eval days
``samples`` times each at every temperature, through corral's full path on this machine (the
bundle served in a thread, the local engine and gateway, the episode player). Each sample's
grade is compared with the greedy rule's on its day. What GRPO can learn from is the samples
that beat the rule: if they occur on few days, more steps will not lift the policy above the
rule (the README's "Why it stops under the greedy rule").

Measured on the 2-core development machine (2026-11-30), 48 days x 16 samples:

- the first H200 run's step-154 policy (a warm start on the greedy rule alone): at temperature
  1.0, 5.9% of the samples beat the rule, 0% graded 0; at 1.5, 5.3% and 10.4%; at 2.0, 0.9% and
  80.1%; at every temperature the better samples fall on the same 3 days of the 48. On all 48
  days the optimum charges more than one battery-full and differs from the rule's schedule in 2
  or more hours (median 4).
- the second run's SFT start (the teacher's price-blind edits on 40% of the days, teacher.py):
  at 1.0, 9.0% better (on 25 of the 48 days), 12.1% graded 0; at 1.2, 8.1% (24 days) and 24.1%;
  at 1.5, 5.3% (18 days) and 51.6%. RL from there beat the rule (README).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.gridsim_rl.report import baseline_days  # noqa: E402

if TYPE_CHECKING:
    from corral.rollouts.evals import EvalReport


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path(__file__).parent / "model")
    parser.add_argument("--days", type=int, default=48)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--temperature", type=float, nargs="+", default=[1.0, 1.5, 2.0])
    args = parser.parse_args()

    from corral.envs.server import build_app
    from corral.rollouts.evals import eval_rows
    from corral.rollouts.rows import RowSettings, read_rows, write_rows
    from corral.serving import serve_in_thread
    from corral.stack import local_stack

    bundle = ROOT / "bundles" / "gridsim"
    console = Console()
    in_flight = args.days * args.samples
    table = Table(title=f"{args.days} eval days x {args.samples} samples against the greedy rule")
    for col in ("T", "better", "gain when better", "equal", "worse", "graded 0",
                "days with a better sample", "mean grade"):  # fmt: skip
        table.add_column(col, justify="right")
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve_in_thread(build_app(bundle, max_concurrent_envs=in_flight)) as env_url,
    ):
        write_rows(env_url, Path(tmp), RowSettings(max_turns=4))
        rows = read_rows(Path(tmp) / "eval.jsonl")[: args.days]
        greedy = {day.task_id: day.greedy for day in baseline_days()}
        with local_stack(args.model, max_batch_size=in_flight) as urls:
            for temperature in args.temperature:
                console.print(f"temperature {temperature}: {in_flight} episodes")
                report = asyncio.run(
                    eval_rows(
                        rows,
                        urls.gateway,
                        n=args.samples,
                        concurrency=in_flight,
                        sampling={"temperature": temperature, "max_tokens": 96},
                    )
                )
                table.add_row(f"{temperature:g}", *_compare(report, greedy))
    console.print(table)
    return 0


def _compare(report: EvalReport, greedy: dict[str, float]) -> list[str]:
    """The table's cells: shares of samples better / equal / worse than the rule on their day,
    graded 0, the mean gain of the better ones, the days with one, the mean grade."""
    episodes = report.episodes
    diffs = [(e.task_id, (e.reward or 0.0) - greedy[e.task_id]) for e in episodes]
    better = [d for _, d in diffs if d > 1e-9]
    equal = sum(abs(d) <= 1e-9 for _, d in diffs)
    zero = sum((e.reward or 0.0) == 0.0 for e in episodes)
    days = {task for task, d in diffs if d > 1e-9}
    total = len(diffs)
    return [
        f"{len(better) / total:.1%}",
        f"{statistics.fmean(better):.3f}" if better else "-",
        f"{equal / total:.1%}",
        f"{(total - len(better) - equal) / total:.1%}",
        f"{zero / total:.1%}",
        f"{len(days)} of {len({t for t, _ in diffs})}",
        f"{statistics.fmean((e.reward or 0.0) for e in episodes):.3f}",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
