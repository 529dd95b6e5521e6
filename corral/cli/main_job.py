"""``corral run``: the main job on embedded defaults (:mod:`corral.run`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from corral.cli.errors import UsageError
from corral.sandboxes.providers import BACKENDS


def cmd_run(args: argparse.Namespace) -> int:
    from corral.bundled import BundledMissing, gridsim_bundle, trained_gridsim_policy
    from corral.run import PolicyMissing, run_main_job

    try:
        bundle = Path(args.bundle) if args.bundle else gridsim_bundle()
    except BundledMissing as exc:
        raise UsageError(str(exc)) from None
    if not (bundle / "bundle.toml").exists():
        raise UsageError(f"no bundle at {bundle} (pass --bundle PATH)")
    # The trained policy plays gridsim only: another bundle gets it only when asked for; a
    # checkout without the committed model still runs the rest.
    policy = Path(args.policy) if args.policy else None
    if policy is None:
        try:
            if bundle.resolve() == gridsim_bundle().resolve():
                policy = trained_gridsim_policy()
        except BundledMissing:
            policy = None
    try:
        return run_main_job(
            workdir=Path(args.workdir),
            episodes=args.episodes,
            seed=args.seed,
            bundle=bundle,
            sandbox=args.sandbox,
            policy=policy,
            policy_days=args.policy_days,
        )
    except PolicyMissing as exc:
        raise UsageError(f"{exc} (--policy)") from None


def add_run_command(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="the main job on embedded defaults (tiny model, engine, gateway, gridsim server)",
        description="Build the tiny model if needed, start the local engine and the gateway on "
        "127.0.0.1, play tool-calling conversations through the OpenAI SDK, and write the "
        "recorded samples and drift report under WORKDIR; then serve the gridsim bundle "
        "(each episode's env in a sandbox), write its rows and play eval episodes over the "
        "WebSocket protocol.",
    )
    run.add_argument("--workdir", default=".corral", help="where models and outputs go")
    run.add_argument("--episodes", type=int, default=4, help="conversations to play")
    run.add_argument("--seed", type=int, default=0, help="seed of the conversations' sampling")
    run.add_argument("--bundle", help="env bundle folder (default: the repository's gridsim)")
    run.add_argument(
        "--sandbox",
        choices=list(BACKENDS),
        default="local",
        help="where the bundle's envs run (local: a subprocess, no isolation)",
    )
    run.add_argument(
        "--policy",
        metavar="PATH",
        help="a model that plays the bundle (default for gridsim: examples/gridsim_rl/model)",
    )
    run.add_argument(
        "--policy-days", type=int, default=24, help="eval days the policy plays (0: none)"
    )
    run.set_defaults(func=cmd_run)
