"""How a training run starts: in this process (every rank under torchrun, the leader with a
progress display), or as a Ray task on the config's ``[ray] address``. Plain functions: the
CLI (:mod:`corral.cli.train`) and scripts call them alike."""

from __future__ import annotations

import asyncio
import math
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from corral.trainer.config import TrainConfig


def train(config: TrainConfig, console: Console | None) -> list[dict[str, Any]]:
    """Run ``config`` here (every rank under torchrun), or as a Ray task on ``[ray] address``,
    and return the leader's metrics lines."""
    # Imported here, not at the top: the CLI imports this module for every command, and the
    # trainer's modules load torch.
    from corral.trainer.config import model_path
    from corral.trainer.loop import Trainer

    if config.ray.address is not None:
        from corral.trainer.ray_cluster import connect, run_on_ray

        connect(config.ray.address)
        gpus = 1 if config.model.device == "cuda" else 0
        lines: list[dict[str, Any]] = run_on_ray(run_training, config, None, num_gpus=gpus)
        return lines
    if torchrun_follower():
        follower = Trainer(config, None, model_path=model_path(config))
        return asyncio.run(follower.run())
    return run_training(config, console)


def run_training(config: TrainConfig, console: Console | None) -> list[dict[str, Any]]:
    """The leader: start the run's services, train with a progress display (one bar for the
    steps, one for the episodes of the current fill or evaluation, a line per step)."""
    from rich.progress import Progress

    from corral.console import make_console
    from corral.trainer.loop import Trainer
    from corral.trainer.services import run_services

    console = console or make_console()
    with Progress(console=console, transient=False) as progress:
        steps = progress.add_task("steps", total=config.schedule.steps)
        work = progress.add_task("rollouts", total=None)

        def on_progress(kind: str, done: int, total: int) -> None:
            progress.update(work, description=kind, completed=done, total=total)

        def on_line(line: dict[str, Any]) -> None:
            progress.update(steps, completed=line["step"])
            console.print(_summary(line))

        with run_services(config) as services:
            trainer = Trainer(config, services, progress=on_progress, on_line=on_line)
            return asyncio.run(trainer.run())


def _summary(line: dict[str, Any]) -> str:
    def num(key: str, fmt: str = ".3f") -> str:
        value = line.get(key)
        return (
            "-"
            if value is None or (isinstance(value, float) and math.isnan(value))
            else (format(value, fmt))
        )

    if line.get("kind") == "eval":
        return (
            f"step {line['step']:>4} eval  reward {num('eval/reward/mean')} ± "
            f"{num('eval/reward/se')}  graded 0: {num('eval/zero_share', '.0%')}  "
            f"failed {line['eval/failed']}"
        )
    dropped = sum(v for k, v in line.items() if k.startswith("dropped/"))
    return (
        f"step {line['step']:>4} train reward {num('reward/mean')}  kl {num('kl', '.4f')}  "
        f"entropy {num('entropy')}  clip {num('clip_fraction')}  dropped {dropped}  "
        f"gen {num('time/generation', '.1f')}s train {num('time/training', '.1f')}s "
        f"sync {num('time/weight_sync', '.2f')}s"
    )


def torchrun_follower() -> bool:
    """Whether this process is a torchrun rank besides the leader (rank 0)."""
    return int(os.environ.get("RANK", "0")) != 0
