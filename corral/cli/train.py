"""``corral train``, ``corral sft`` and ``corral plot``: argument parsing, the progress
display and the one-line errors around :func:`~corral.trainer.launch.train`,
:func:`~corral.trainer.sft_run.run_sft` and :func:`~corral.trainer.plot.plot_run`, which raise
the trainer's own errors."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from corral.trainer.launch import torchrun_follower, train


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
    train.add_argument(
        "config", nargs="?", help="a TOML file (docs/training.md lists its sections and keys)"
    )
    _add_set_option(train, "SECTION.KEY=VALUE", "--set rollout.temperature=1.2")
    train.add_argument("--run-dir", help="the run folder (default from the config: runs/train)")
    train.add_argument(
        "--steps", type=int, help="updates to reach (default from the config: schedule.steps)"
    )
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
    sft.add_argument("--data", required=True, help="the training conversations (JSONL)")
    sft.add_argument("--eval-data", help="held-out conversations for eval/loss")
    sft.add_argument("--model", help="the starting model (default: the tiny model)")
    sft.add_argument("--run-dir", help="the run folder (default runs/sft)")
    _add_set_option(sft, "KEY=VALUE", "--set optim.lr=3e-4 --set epochs=2")
    sft.set_defaults(func=cmd_sft)

    plot = sub.add_parser(
        "plot",
        help="plot a training run's curves to a PNG",
        description="Draws a run's metrics.jsonl: rewards with standard errors, the update, "
        "the time split and the dropped groups.",
    )
    plot.add_argument("run", help="the run folder (or its metrics.jsonl)")
    plot.add_argument("--out", help="the PNG (default RUN/curves.png)")
    plot.set_defaults(func=cmd_plot)


def cmd_train(args: argparse.Namespace) -> int:
    """``corral train``: exit 0 when the run reached its steps (or had already: a message says
    so), 2 for a config that cannot run here, 1 when training failed."""
    from corral.cli.errors import RunError
    from corral.console import make_console
    from corral.envs.bundle import BundleError
    from corral.rollouts.rows import RowsError
    from corral.trainer.checkpoint import latest_step
    from corral.trainer.groups import BatchUnfillable
    from corral.trainer.services import ServicesError
    from corral.trainer.weights import WeightSyncError

    overrides = _overrides(args, (("run_dir", "run_dir"), ("ray", "ray.address")))
    if args.steps is not None:
        overrides.append(f"schedule.steps={args.steps}")
    config = _config("load_config", args.config, overrides)
    if config.ray.address is None:  # on Ray the GPU is the cluster's, not this machine's
        _check_device(config.model.device)
    done = latest_step(config.run_dir)
    if done is not None and done >= config.schedule.steps:
        print(
            f"corral train: run {config.run_dir} already finished {done} steps; pass --steps M "
            f"(more than {done}) to continue or a new --run-dir",
            file=sys.stderr,
        )
        return 0  # like make's "up to date": nothing to do is not a failure
    # megatron warns at import that Transformer Engine and Apex are absent: its local layers
    # are the ones corral builds on, by design.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex)")
    # Imported before any service starts: a missing megatron-core is one line, not a
    # traceback after the engine, gateway and env server came up.
    import megatron.core  # noqa: F401

    console = make_console()
    try:
        lines = train(config, console)
    except (BatchUnfillable, WeightSyncError, BundleError, ServicesError, RowsError) as exc:
        raise RunError(str(exc)) from exc
    if lines:
        _report(console, config.run_dir)
    return 0


def _config(loader: str, path: str | None, overrides: list[str]) -> Any:
    """The config that ``corral.trainer.config.<loader>`` reads from ``path`` with
    ``overrides``; its ConfigError (a bad file, ``--set`` item, key or value) as a
    UsageError."""
    from corral.cli.errors import UsageError
    from corral.trainer import config as configs

    try:
        return getattr(configs, loader)(Path(path) if path else None, overrides)
    except configs.ConfigError as exc:
        raise UsageError(str(exc), "Fix the config file or the --set item.") from None


def _check_device(device: str) -> None:
    """A UsageError, before anything starts, when ``model.device`` is cuda and this torch
    cannot use a GPU."""
    if device != "cuda":
        return
    import torch

    from corral.cli.errors import UsageError

    if torch.cuda.is_available():
        return
    why = (
        f"this torch has no CUDA (torch {torch.__version__}, a CPU-only build)"
        if torch.version.cuda is None
        else f"this torch (CUDA {torch.version.cuda}) sees no GPU"
    )
    raise UsageError(
        f"model.device=cuda but {why}",
        "Run on a machine with a GPU and a CUDA build of torch, or set model.device=cpu.",
    )


def _report(console: Any, run_dir: Path) -> None:
    metrics = run_dir / "metrics.jsonl"
    try:
        from corral.trainer.plot import plot_run

        console.print(f"metrics in {metrics}; curves in {plot_run(run_dir)}")
    except ImportError:  # matplotlib is the train extra's; a bare GPU box may lack it
        console.print(f"metrics in {metrics} (no plot: matplotlib is not installed)")


def _overrides(args: argparse.Namespace, flags: Sequence[tuple[str, str]]) -> list[str]:
    """The ``--set`` overrides, then one per path or address flag given: ``(attribute, key)``
    pairs, the value written as a TOML string."""
    overrides = list(args.overrides)
    for flag, key in flags:
        value = getattr(args, flag)
        if value:
            overrides.append(f"{key}={_toml_string(value)}")
    return overrides


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def cmd_sft(args: argparse.Namespace) -> int:
    """``corral sft``: exit 0 with the model written, 2 for a config that cannot run here, 1
    for data or files that fail."""
    from rich.progress import Progress

    from corral.cli.errors import RunError
    from corral.console import make_console
    from corral.trainer.sft_run import run_sft

    overrides = _overrides(args, (("data", "data"), ("eval_data", "eval_data"),
                                  ("model", "model.path"), ("run_dir", "run_dir")))  # fmt: skip
    config = _config("load_sft_config", args.config, overrides)
    _check_device(config.model.device)
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex)")
    if torchrun_follower():  # no display: the leader shows the run
        try:
            run_sft(config)
        except (OSError, ValueError) as exc:
            raise RunError(str(exc)) from exc
        return 0
    console = make_console()
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
            raise RunError(str(exc)) from exc
    console.print(f"model in {config.run_dir / 'model'}")
    _report(console, config.run_dir)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from corral.cli.errors import RunError
    from corral.trainer.plot import plot_run

    try:
        out = plot_run(Path(args.run), Path(args.out) if args.out else None)
    except FileNotFoundError as exc:
        raise RunError(
            f"no metrics at {exc.filename or args.run}",
            "Pass a run folder that `corral train` or `corral sft` wrote.",
        ) from None
    except (OSError, ValueError) as exc:
        raise RunError(str(exc)) from None
    print(out)
    return 0
