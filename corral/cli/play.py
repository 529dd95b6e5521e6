"""``corral play``: play rows with a black-box agent, in the episode's own sandbox
(``--harness``, :mod:`corral.rollouts.harness_play`) or on this host (``--agent-cmd``,
:mod:`corral.adapters.agents`); write the episodes, samples and summary under ``--out``, and
each episode's spans to ``--out``/traces.jsonl as it ends (:mod:`corral.rollouts.traces`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from corral.adapters import agents
from corral.cli.checks import probe_gateway, rows_file
from corral.cli.errors import CliError, RunError, UsageError, error_line, first_of
from corral.cli.harness import harness_options
from corral.env_secrets import SecretMissing, env_secret
from corral.gateway.client import GatewayAdmin
from corral.rollouts import harness_play
from corral.rollouts.evals import report_play
from corral.rollouts.harness_play import HarnessOptions, HarnessPlayer, add_harness_arguments
from corral.rollouts.player import PlayerError
from corral.rollouts.rows import Row, RowsError, read_rows
from corral.rollouts.traces import TraceWriter


def add_play_command(sub: argparse._SubParsersAction) -> None:
    """Add ``corral play`` to the CLI's subcommands."""
    play = sub.add_parser(
        "play",
        help="play rows with a black-box agent: in the episode's sandbox (--harness) or here",
        description="For each row, opens a gateway session and an episode and lets an agent "
        "play it. With --harness (claude-code, codex, command) the env server runs the agent "
        "inside the episode's own sandbox, its traffic bridged to its gateway session, and "
        "grades the workspace it leaves; the agent's transcripts go to OUT/transcripts/. "
        "Without it, --agent-cmd runs on THIS host (development only): it gets "
        "OPENAI_BASE_URL / OPENAI_API_KEY set to its session and CORRAL_MCP_URL / "
        "CORRAL_MCP_TOKEN (the episode's tools over MCP) / CORRAL_TASK_PROMPT / "
        "CORRAL_SYSTEM_PROMPT / CORRAL_TASK_ID. When it exits the episode is ended and graded "
        "and the reward lands on the session; an agent that times out or exits non-zero, or "
        "an env that fails, flags the episode failed (never a 0). Writes episodes.jsonl, "
        "samples.jsonl, summary.json and traces.jsonl (each episode's spans, for `corral "
        "view`) under --out and prints the mean reward over the "
        "scored episodes with its standard error. Exits 1 when no episode was scored.",
    )
    play.add_argument("rows", help="a rows file (JSONL written by `corral rows`)")
    play.add_argument("--gateway", required=True, help="the gateway URL")
    play.add_argument(
        "--agent-cmd",
        help='the agent command, e.g. "python examples/agent.py": on this host, or with '
        "--harness command in the sandbox",
    )
    add_harness_arguments(play, agent_cmd=False, timeout=False)
    play.add_argument(
        "--admin-token-var",
        metavar="NAME",
        help="environment variable holding the gateway's admin token (hidden from the agent)",
    )
    play.add_argument("--split", help="play only the rows of this split (default: all)")
    play.add_argument("--limit", type=int, metavar="N", help="play the first N rows only")
    play.add_argument("--concurrency", type=int, default=4, help="episodes at once")
    play.add_argument(
        "--timeout", type=float, default=600.0, help="seconds the agent may run per episode"
    )
    play.add_argument(
        "--out", default=".corral/play", help="where episodes, samples and summary go"
    )
    play.set_defaults(func=cmd_play)


def cmd_play(args: argparse.Namespace) -> int:
    """``corral play``: exit 0 when at least one episode was scored, 1 when none was (every
    episode failed or none was selected) or the gateway cannot be used, 2 for a configuration
    error. Errors are the one line ``corral`` prints for a :class:`~corral.cli.errors.CliError`,
    also when this is called without ``corral.cli.main`` (the exit code is returned either
    way)."""
    try:
        return _play(args)
    except CliError as exc:
        line, code = error_line("play", exc)
        print(line, file=sys.stderr)
        return code


def _play(args: argparse.Namespace) -> int:
    try:
        admin_token = env_secret(args.admin_token_var or None, "the gateway admin token")
    except SecretMissing as exc:
        raise UsageError(str(exc), f"Export {args.admin_token_var}.") from None
    options = harness_options(args)
    if options is None and not args.agent_cmd:
        raise UsageError("give --agent-cmd (an agent on this host) or --harness")
    try:
        rows = read_rows(rows_file(args.rows), split=args.split, limit=args.limit)
    except RowsError as exc:
        raise UsageError(str(exc), "Pass a file written by `corral rows`.") from None
    if not rows:
        raise RunError(f"no rows selected from {args.rows}")
    # The folder is known now: each episode's spans are written there as it ends.
    trace = TraceWriter(Path(args.out))
    if options is not None:
        return _play_with_harness(args, rows, admin_token, options, trace)
    agents.make_undumpable()
    return _play_on_host(args, rows, admin_token, trace)


def _play_on_host(
    args: argparse.Namespace, rows: list[Row], admin_token: str | None, trace: TraceWriter
) -> int:
    """Host mode: the agent command runs on this machine (development only: nothing but
    its environment keeps it from this user's files)."""
    from rich.progress import Progress

    hidden = [args.admin_token_var] if args.admin_token_var else []

    async def play_all(progress: Progress) -> list[agents.AgentRollout]:
        async with GatewayAdmin(args.gateway, admin_token) as gateway:
            await probe_gateway(gateway, args.admin_token_var or None)
            task = progress.add_task("playing", total=len(rows))
            return await agents.play_rows_with_agent(
                rows,
                gateway=gateway,
                agent_cmd=args.agent_cmd,
                concurrency=args.concurrency,
                timeout_s=args.timeout,
                hidden_vars=hidden,
                on_done=lambda _: progress.advance(task),
                trace=trace,
            )

    try:
        with Progress(transient=True) as progress:
            rollouts = asyncio.run(play_all(progress))
    except agents.AgentConfigError as exc:
        raise UsageError(str(exc)) from None
    out = Path(args.out)
    summary = agents.write_play_outputs(out, rollouts)
    failures = [(r.task_id, r.reason) for r in rollouts if r.failed]
    return report_play(summary, failures, out)


def _play_with_harness(
    args: argparse.Namespace,
    rows: list[Row],
    admin_token: str | None,
    options: HarnessOptions,
    trace: TraceWriter,
) -> int:
    """``corral play --harness``: play ``rows`` through a
    :class:`~corral.rollouts.harness_play.HarnessPlayer`, write the outputs under ``--out``,
    print the mean; the exit code as ``corral play``'s."""
    from rich.progress import Progress

    async def play_all(progress: Progress) -> list[harness_play.HarnessRollout]:
        async with GatewayAdmin(args.gateway, admin_token) as gateway:
            await probe_gateway(gateway, args.admin_token_var or None)
            task = progress.add_task(f"playing ({options.harness.name})", total=len(rows))
            async with HarnessPlayer.of(gateway, options, trace=trace) as player:
                return await harness_play.play_rows(
                    player,
                    rows,
                    concurrency=args.concurrency,
                    on_done=lambda _: progress.advance(task),
                )

    try:
        with Progress(transient=True) as progress:
            rollouts = asyncio.run(play_all(progress))
    except (ValueError, ExceptionGroup) as exc:
        if (refused := first_of(exc, PlayerError)) is not None:
            raise RunError(str(refused)) from None
        if isinstance(exc, ValueError):
            raise UsageError(str(exc)) from None
        raise
    out = Path(args.out)
    summary = harness_play.write_play_outputs(out, rollouts)
    failures = [(r.row.metadata.task_id, r.reason) for r in rollouts if r.failed]
    return report_play(summary, failures, out)
