"""A training step's rollouts: the trainer's services as threads of one interpreter against
the same services as child processes (``[engine] processes``, ``[env] processes``).

Run: ``python bench/fill.py [--groups 32] [--per-row 8] [--fills 3]``.

Both layouts serve the same small model (the gridsim example's smoke model: two layers of
32, so the model's own compute is small and what is measured is corral's: the engine's
scheduler, the gateway, the env server and the player) and play gridsim train rows,
``groups x per-row`` rollouts at once, at temperature 1 with ``max_tokens`` 48, as
:class:`~corral.trainer.rollouts.GroupDraw` does for a step. Each layout plays ``--fills``
fills after one warm-up fill; the table gives the median wall time of a fill and the ratio
threads / processes (the baseline is the threads layout, measured in the same run). Target:
processes at least 1.3x faster at 256 rollouts in flight on a machine with two or more cores
(measured on the 2-core development machine, 2026-11-30: 5.24 s against 2.92 s, 1.80x).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from corral.trainer.services import Services

ROOT = Path(__file__).resolve().parent.parent


def small_model(out: Path) -> Path:
    """The gridsim example's smoke model: its BPE trained on gridsim's text (a task prompt is
    ~220 tokens) and a random 2-layer, 32-wide Qwen3 (built in ~15 s by the example itself)."""
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gridsim_rl" / "run.py"), "--smoke",
         "--out", str(out), "--stage", "data", "--stage", "model"],
        check=True, capture_output=True,
    )  # fmt: skip
    return out / "base_model"


async def fills(svc: Services, groups: int, per_row: int, n: int) -> list[float]:
    from corral.gateway.client import GatewayAdmin
    from corral.rollouts.player import Player
    from corral.trainer.rollouts import GroupDraw
    from corral.trainer.sampling import RowSampler

    sampling = {"temperature": 1.0, "max_tokens": 48}
    times = []
    async with (
        GatewayAdmin(svc.gateway) as admin,
        Player(admin, sampling=sampling) as player,
    ):
        draw = GroupDraw(
            player,
            RowSampler(svc.train_rows, seed=0),
            rollouts_per_row=per_row,
            concurrency=groups * per_row,
            seed=0,
        )
        for i in range(n + 1):
            began = time.perf_counter()
            await draw(groups)
            if i:  # the first fill warms the servers up
                times.append(time.perf_counter() - began)
            failed = [r for r in draw.take_played() if r.failed]
            assert not failed, failed[0].reason
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--per-row", type=int, default=8)
    parser.add_argument("--fills", type=int, default=3)
    args = parser.parse_args()

    from corral.trainer.config import TrainConfig
    from corral.trainer.services import run_services

    console = Console()
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = small_model(Path(tmp) / "example")
        in_flight = args.groups * args.per_row
        for layout, processes in (("threads", False), ("processes", True)):
            config = TrainConfig.model_validate(
                {
                    "run_dir": str(Path(tmp) / layout),
                    "model": {"path": str(model)},
                    "env": {"bundle": str(ROOT / "bundles" / "gridsim"), "sandbox": None,
                            "processes": processes},
                    "engine": {"max_batch_size": in_flight, "processes": processes},
                    "rollout": {"concurrency": in_flight},
                }
            )  # fmt: skip
            console.print(f"{layout}: {args.fills} fills of {in_flight} rollouts")
            with run_services(config) as services:
                results[layout] = asyncio.run(
                    fills(services, args.groups, args.per_row, args.fills)
                )
    threads, processes = (statistics.median(results[k]) for k in ("threads", "processes"))
    table = Table(title=f"one fill of {args.groups} x {args.per_row} gridsim rollouts")
    for col in ("layout", "median fill (s)", "fills (s)"):
        table.add_column(col, justify="right")
    for layout, times in results.items():
        table.add_row(
            layout, f"{statistics.median(times):.2f}", " ".join(f"{t:.2f}" for t in times)
        )
    console.print(table)
    console.print(f"threads / processes: {threads / processes:.2f}x (target >= 1.3x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
