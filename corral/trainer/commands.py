"""``corral train`` and ``corral plot``: argument parsing and display around
:class:`~corral.trainer.loop.Trainer` and :func:`~corral.trainer.plot.plot_run`."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _add_set_option(parser: argparse.ArgumentParser, metavar: str, example: str) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``, read as TOML by the config."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar=metavar,
        help=f"override one setting, e.g. {example} (repeatable)",
    )


def add_train_commands(sub: Any) -> None:
    train = sub.add_parser(
        "train",
        help="train a policy with GRPO through the gateway and env server",
        description="Runs the RL loop: rows from the env server, rollouts through the "
        "gateway, the group filter, a Megatron-core policy update, the weight push to the "
        "engines, evaluation and checkpoints. With no CONFIG: the tiny model, the local engine "
        "and gateway, and gridsim in local sandboxes, all in this process. A run folder with a "
        "checkpoint resumes. Writes RUN/metrics.jsonl, RUN/tensorboard, RUN/checkpoints, "
        "RUN/evals and RUN/curves.png.",
    )
    train.add_argument("config", nargs="?", help="a TOML file (see README: the trainer)")
    _add_set_option(train, "SECTION.KEY=VALUE", "--set rollout.temperature=1.2")
    train.add_argument("--run-dir", help="the run folder (default from the config: runs/train)")
    train.add_argument("--steps", type=int, help="updates to reach (schedule.steps)")
    train.add_argument("--ray", metavar="ADDRESS", help="place workers on this Ray cluster")
    train.set_defaults(func=cmd_train)

    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning on chat transcripts (the warm start before RL)",
        description="Trains the policy on conversations in OpenAI's chat fine-tuning JSONL "
        "shape (tool calls included), rendered exactly as the gateway renders them, with the "
        "loss on the assistant's tokens. Writes RUN/metrics.jsonl, RUN/checkpoints and the "
        "result as a Hugging Face folder, RUN/model (an RL run's model.path).",
    )
    sft.add_argument("config", nargs="?", help="a TOML file of SftConfig fields")
    sft.add_argument("--data", help="the training conversations (JSONL)")
    sft.add_argument("--eval-data", help="held-out conversations for eval/loss")
    sft.add_argument("--model", help="the starting model (default: the tiny model)")
    sft.add_argument("--run-dir", help="the run folder (default runs/sft)")
    _add_set_option(sft, "KEY=VALUE", "--set optim.lr=3e-4 --set epochs=2")
    sft.set_defaults(func=cmd_sft)

    plot = sub.add_parser("plot", help="plot a training run's curves to a PNG")
    plot.add_argument("run", help="the run folder (or its metrics.jsonl)")
    plot.add_argument("--out", help="the PNG (default RUN/curves.png)")
    plot.set_defaults(func=cmd_plot)


def cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from corral.adapters.rows import RowsError
    from corral.envs.bundle import BundleError
    from corral.trainer.config import ConfigError, load_config
    from corral.trainer.groups import BatchUnfillable
    from corral.trainer.services import ServicesError
    from corral.trainer.weights import WeightSyncError

    overrides = _overrides(args, (("run_dir", "run_dir"), ("ray", "ray.address")))
    if args.steps is not None:
        overrides.append(f"schedule.steps={args.steps}")
    try:
        config = load_config(Path(args.config) if args.config else None, overrides)
    except ConfigError as exc:
        print(f"corral train: {exc}", file=sys.stderr)
        return 2
    # megatron warns at import that Transformer Engine and Apex are absent: its local layers
    # are the ones corral builds on, by design.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex)")
    console = Console()
    try:
        lines = train(config, console)
    except (BatchUnfillable, WeightSyncError, BundleError, ServicesError, RowsError) as exc:
        console.print(f"[red]corral train: {exc}")
        return 1
    if lines:
        _report(console, config.run_dir)
    return 0


def _report(console: Any, run_dir: Path) -> None:
    metrics = run_dir / "metrics.jsonl"
    try:
        from corral.trainer.plot import plot_run

        console.print(f"metrics in {metrics}; curves in {plot_run(run_dir)}")
    except ImportError:  # matplotlib is the train extra's; a bare GPU box may lack it
        console.print(f"metrics in {metrics} (no plot: matplotlib is not installed)")


def train(config: Any, console: Any) -> list[dict[str, Any]]:
    """Run ``config`` here (every rank under torchrun), or as a Ray task on ``[ray] address``,
    and return the leader's metrics lines."""
    from corral.trainer.loop import Trainer
    from corral.trainer.services import model_path

    if config.ray.address is not None:
        from corral.trainer.ray_cluster import connect, run_on_ray

        connect(config.ray.address)
        gpus = 1 if config.model.device == "cuda" else 0
        lines: list[dict[str, Any]] = run_on_ray(run_training, config, None, num_gpus=gpus)
        return lines
    if _torchrun_follower():
        follower = Trainer(config, None, model_path=model_path(config))
        return asyncio.run(follower.run())
    return run_training(config, console)


def run_training(config: Any, console: Any | None) -> list[dict[str, Any]]:
    """The leader: start the run's services, train with a progress display (one bar for the
    steps, one for the episodes of the current fill or evaluation, a line per step)."""
    from rich.console import Console
    from rich.progress import Progress

    from corral.trainer.loop import Trainer
    from corral.trainer.services import run_services

    console = console or Console()
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


def _overrides(args: argparse.Namespace, flags: Sequence[tuple[str, str]]) -> list[str]:
    """The ``--set`` overrides, then one per path or address flag given: ``(attribute, key)``
    pairs, the value written as a TOML string."""
    overrides = list(args.overrides)
    for flag, key in flags:
        value = getattr(args, flag)
        if value:
            overrides.append(f"{key}={_toml_string(value)}")
    return overrides


def _torchrun_follower() -> bool:
    """Whether this process is a torchrun rank besides the leader (rank 0)."""
    return int(os.environ.get("RANK", "0")) != 0


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def cmd_sft(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from corral.trainer.config import ConfigError, load_sft_config
    from corral.trainer.sft_run import run_sft

    overrides = _overrides(args, (("data", "data"), ("eval_data", "eval_data"),
                                  ("model", "model.path"), ("run_dir", "run_dir")))  # fmt: skip
    try:
        config = load_sft_config(Path(args.config) if args.config else None, overrides)
    except ConfigError as exc:
        print(f"corral sft: {exc}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex)")
    if _torchrun_follower():  # no display: the leader shows the run
        try:
            run_sft(config)
        except (OSError, ValueError) as exc:
            print(f"corral sft: {exc}", file=sys.stderr)
            return 1
        return 0
    console = Console()
    with Progress(console=console) as progress:
        bar = progress.add_task("steps", total=None)

        def on_line(line: dict[str, Any]) -> None:
            if line.get("kind") == "eval":
                console.print(f"step {line['step']:>5} eval loss {line['eval/loss']:.4f} "
                              f"accuracy {line['eval/accuracy']:.3f}")  # fmt: skip
            else:
                progress.update(bar, completed=line["step"])
                progress.update(bar, description=f"loss {line['loss']:.4f}")

        try:
            run_sft(config, on_line=on_line)
        except (OSError, ValueError) as exc:
            console.print(f"[red]corral sft: {exc}")
            return 1
    console.print(f"model in {config.run_dir / 'model'}")
    _report(console, config.run_dir)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from corral.trainer.plot import plot_run

    try:
        out = plot_run(Path(args.run), Path(args.out) if args.out else None)
    except (OSError, ValueError) as exc:
        print(f"corral plot: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0
