"""``corral bundle validate``: read a bundle and explain every problem; with ``--play``, play it
(:mod:`corral.envs.playcheck`) and print a table per split."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from corral.cli.errors import RunError, UsageError
from corral.envs.playcheck import DEFAULT_MARGIN, DEFAULT_SEED, DEFAULT_TASKS
from corral.sandboxes.base import SandboxError
from corral.sandboxes.providers import BACKENDS


def cmd_bundle_validate(args: argparse.Namespace) -> int:
    import sys

    from corral.envs.bundle import validate_bundle

    if not args.play:
        given = [flag for flag, value in _play_only_flags(args) if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only apply with --play", "Add --play.")
    problems = validate_bundle(Path(args.path))
    for problem in problems:
        print(f"{args.path}: {problem}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s) found", file=sys.stderr)
        return 1
    if args.play:
        return _play_bundle(args)
    print(f"{args.path}: ok")
    return 0


def _play_only_flags(args: argparse.Namespace) -> list[tuple[str, Any]]:
    return [
        ("--sandbox", args.sandbox),
        ("--sandbox-image", args.sandbox_image),
        ("--tasks", args.tasks),
        ("--margin", args.margin),
        ("--seed", args.seed),
        ("--split", args.split),
    ]


def _play_bundle(args: argparse.Namespace) -> int:
    """``bundle validate --play``: play the bundle (corral.envs.playcheck), print a table per
    split, a reason line per failed check on stderr; exit 1 when any check failed."""
    import asyncio
    import os
    import sys

    from rich.progress import Progress

    from corral.console import make_console, print_table
    from corral.envs.bundle import load_bundle
    from corral.envs.hosting import env_host
    from corral.envs.playcheck import PlaySettings, planned_episodes, play_check_hosted
    from corral.sandboxes.providers import make_provider

    try:
        settings = PlaySettings(
            tasks=DEFAULT_TASKS if args.tasks is None else args.tasks,
            margin=DEFAULT_MARGIN if args.margin is None else args.margin,
            seed=DEFAULT_SEED if args.seed is None else args.seed,
            splits=tuple(args.split) if args.split else None,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    bundle = load_bundle(Path(args.path))
    try:
        planned = planned_episodes(bundle, settings)
        provider = None
        if args.sandbox is not None:
            # An owner of its own: opening the host sweeps the owner's leftovers, and a
            # `corral serve` of this bundle must keep its sandboxes.
            owner = f"validate-{bundle.name}-{os.getpid()}"
            image = args.sandbox_image or bundle.manifest.sandbox.image
            provider = make_provider(args.sandbox, owner, image=image)
        host = env_host(bundle, provider)
    except SandboxError as exc:
        raise RunError("; ".join(str(exc).splitlines())) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    console = make_console()
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task(f"playing {bundle.name} ({host.description})", total=planned)
        try:
            report = asyncio.run(
                play_check_hosted(
                    bundle,
                    host,
                    settings,
                    lambda label: progress.update(bar, advance=1, description=label),
                )
            )
        except SandboxError as exc:
            raise RunError("; ".join(str(exc).splitlines())) from None
    for table in _play_tables(report):
        print_table(console, table)
    failures = report.failures()
    for line in failures:
        print(f"{args.path}: FAIL {line}", file=sys.stderr)
    checks = sum(1 for _ in report.all_checks())
    if failures:
        print(f"{len(failures)} of {checks} play check(s) failed", file=sys.stderr)
        return 1
    console.print(f"{args.path}: ok, all {checks} play checks pass ({host.description})")
    return 0


def _play_tables(report: Any) -> list[Any]:
    """The bundle-wide checks, then a table per split: each policy's rewards, its checks."""
    from rich.markup import escape
    from rich.table import Table

    def verdict(passed: bool) -> str:
        return "[green]pass[/green]" if passed else "[bold red]FAIL[/bold red]"

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    bundle = Table(title=f"{report.bundle}: bundle-wide checks ({report.host})")
    for column in ("check", "result", "detail"):
        bundle.add_column(column)
    for check in report.checks:
        bundle.add_row(check.name, verdict(check.passed), escape(check.detail))
    tables = [bundle]
    for split in report.splits:
        title = (
            f"{report.bundle} split {split.split}: {len(split.task_ids)} task(s), seed "
            f"{report.settings.seed}, max reward {split.max_reward:.3f}"
        )
        table = Table(title=title)
        for column in ("policy / check", "result", "mean", "min", "max", "detail"):
            table.add_column(
                column, justify="right" if column in ("mean", "min", "max") else "left"
            )
        for policy in (split.solver, split.do_nothing, *split.baselines):
            rewards = policy.rewards
            failed = len(policy.failed)
            detail = f"{len(policy.episodes)} episode(s)" + (f", {failed} failed" if failed else "")
            table.add_row(
                escape(policy.name),
                "",
                number(policy.mean),
                number(min(rewards) if rewards else None),
                number(max(rewards) if rewards else None),
                detail,
            )
        table.add_section()
        for check in split.checks:
            table.add_row(check.name, verdict(check.passed), "", "", "", escape(check.detail))
        tables.append(table)
    return tables


def add_bundle_command(sub: Any) -> None:
    bundle = sub.add_parser(
        "bundle", help="env bundles", description="Work with env bundles."
    ).add_subparsers(dest="bundle_command", required=True, metavar="ACTION")
    validate = bundle.add_parser(
        "validate",
        help="check a bundle and explain every problem found",
        description="Checks bundle.toml, the tool schemas, every task line, and that the env "
        "and verifier code import. Runs the bundle's code in this process. With --play it "
        "also plays the bundle on a seeded sample of each split (the [solver], doing nothing, "
        "the [[baselines]], malformed tool calls) through the env host, in a sandbox with "
        "--sandbox, and checks the solver reaches the maximum reward, doing nothing stays "
        "--margin below it, grades repeat, no hidden data or answer reaches the model or the "
        "sandbox payload, and every tool answers malformed calls with a tool error.",
    )
    validate.add_argument("path", help="the bundle folder")
    validate.add_argument("--play", action="store_true", help="play the bundle, not only read it")
    # The play options default to None so that giving one without --play is an error; their
    # defaults live in corral.envs.playcheck.PlaySettings.
    validate.add_argument(
        "--sandbox",
        choices=BACKENDS,
        help="run each episode's env in this sandbox backend (default: in this process, "
        'which a bundle with [sandbox] needs = "process" refuses)',
    )
    validate.add_argument(
        "--sandbox-image", metavar="IMAGE", help="docker/kubernetes image or e2b template"
    )
    validate.add_argument(
        "--tasks", type=int, metavar="N", help=f"tasks sampled per split (default: {DEFAULT_TASKS})"
    )
    validate.add_argument(
        "--margin",
        type=float,
        metavar="M",
        help="how far below the solver's mean reward doing nothing must stay "
        f"(default: {DEFAULT_MARGIN:g})",
    )
    validate.add_argument(
        "--seed", type=int, help=f"the task sample's seed (default: {DEFAULT_SEED})"
    )
    validate.add_argument(
        "--split", action="append", metavar="NAME", help="play only this split (repeatable)"
    )
    validate.set_defaults(func=cmd_bundle_validate)
