"""``corral harness``: the black-box agent harnesses (``list``) and their CLIs (``install``);
and :func:`harness_options`, which reads back the ``--harness`` flags of ``corral play`` and
``corral eval`` (:func:`~corral.rollouts.harness_play.add_harness_arguments`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from corral.cli.errors import RunError, UsageError
from corral.rollouts.harness_play import HarnessOptions, make_harness, origin


def add_harness_command(sub: Any) -> None:
    """Add ``corral harness list`` and ``corral harness install`` to the CLI's subcommands."""
    from corral.harnesses.clis import CLIS_DIR_VAR

    harness = sub.add_parser(
        "harness",
        help="the black-box agent harnesses and the agent CLIs they run",
        description="Harnesses run a black-box agent (Claude Code, Codex CLI, any command) "
        "headless in an episode's sandbox, on its own gateway session.",
    ).add_subparsers(dest="harness_command", required=True, metavar="ACTION")
    where = (
        f"the CLIs' npm install folder (default: ${CLIS_DIR_VAR}, else ~/.cache/corral/agent-clis)"
    )
    listing = harness.add_parser(
        "list",
        help="each harness, what it needs, and whether its CLI is installed",
        description="Prints one line per harness: its name, its settings, the agent CLI it "
        "runs and where that CLI was found (or how to install it). Exits 0.",
    )
    listing.add_argument("--clis", type=Path, metavar="DIR", help=where)
    listing.set_defaults(func=cmd_harness_list)
    install = harness.add_parser(
        "install",
        help="install the pinned Claude Code and Codex CLIs (npm)",
        description="npm install --prefix DIR of the pinned @anthropic-ai/claude-code and "
        "@openai/codex (about 760 MB; needs npm, and the npm registry, to install only). "
        "Skipped when both are there at those versions. Prints claude=PATH and codex=PATH.",
    )
    install.add_argument("dir", nargs="?", type=Path, metavar="DIR", help=where)
    install.add_argument("--force", action="store_true", help="reinstall even when up to date")
    install.set_defaults(func=cmd_harness_install)


def cmd_harness_list(args: argparse.Namespace) -> int:
    from corral.harnesses import HARNESSES, settings_of
    from corral.harnesses.clis import default_clis_dir, find_clis

    folder = args.clis or default_clis_dir()
    clis = find_clis(folder)
    for name, cls in sorted(HARNESSES.items()):
        settings = ", ".join(settings_of(cls)) or "none"
        if cls.needs is None:
            found = "needs no agent CLI"
        else:
            path = clis.get(cls.needs)
            found = (
                f"{cls.needs}: {path}"
                if path is not None
                else f"{cls.needs}: not installed in {folder} (corral harness install)"
            )
        print(f"{name}: {cls.about}\n    settings: {settings}\n    {found}")
    return 0


def cmd_harness_install(args: argparse.Namespace) -> int:
    from corral.harnesses.clis import CliInstallError, default_clis_dir, install_clis

    folder = args.dir or default_clis_dir()
    try:
        clis = install_clis(
            folder, force=args.force, progress=lambda line: print(line, file=sys.stderr)
        )
    except CliInstallError as exc:
        raise RunError(str(exc)) from exc
    print(f"claude={clis.claude}")
    print(f"codex={clis.codex}")
    return 0


def harness_options(args: argparse.Namespace) -> HarnessOptions | None:
    """The :class:`~corral.rollouts.harness_play.HarnessOptions` of parsed
    :func:`~corral.rollouts.harness_play.add_harness_arguments` flags, ``None`` without
    ``--harness``. Raises :class:`~corral.cli.errors.UsageError` for flags that do not go
    together or a harness that refuses its options."""
    name = getattr(args, "harness", None)
    agent_cmd = getattr(args, "agent_cmd", None)
    agent_dir = getattr(args, "agent_dir", None)
    if name is None:
        if agent_dir is not None or getattr(args, "sandbox_gateway", None) is not None:
            raise UsageError("--agent-dir and --sandbox-gateway go with --harness")
        return None
    if name == "command" and not agent_cmd:
        raise UsageError("--harness command needs --agent-cmd", 'e.g. --agent-cmd "python a.py"')
    if name != "command" and (agent_cmd or agent_dir):
        raise UsageError(f"--agent-cmd and --agent-dir go with --harness command, not {name}")
    timeout_s = float(getattr(args, "timeout", 600.0))
    if timeout_s <= 0:
        raise UsageError("--timeout must be positive")
    try:
        harness = make_harness(name, agent_cmd=agent_cmd, agent_dir=agent_dir)
        sandbox_gateway = args.sandbox_gateway and origin(args.sandbox_gateway)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return HarnessOptions(harness, timeout_s, args.model, sandbox_gateway or None)
