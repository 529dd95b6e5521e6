"""``corral rows`` (an env server's tasks as training rows) and ``corral eval`` (rows played
through the gateway, the mean reward reported)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from corral.cli.checks import gateway_error, probe_gateway, rows_file
from corral.cli.errors import RunError, UsageError, first_of
from corral.cli.options import (
    token_from_env,
)
from corral.rollouts.rows import RowSettings

# Where a default lives in the component, the flag takes it from there.
_ROWS = RowSettings()


def cmd_rows(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from corral.rollouts.rows import RowsError, write_rows

    token = token_from_env(args.token_var, "--token-var")
    settings = RowSettings(
        max_turns=args.max_turns,
        tool_timeout=args.tool_timeout,
        reset_timeout=args.reset_timeout,
        model_timeout=args.model_timeout,
        token_var=args.token_var,
    )
    with Progress(transient=True) as progress:
        task = progress.add_task("reading tasks", total=None)
        try:
            counts = write_rows(
                args.url,
                Path(args.outdir),
                settings,
                token=token,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
        except RowsError as exc:
            raise RunError(str(exc), "Is `corral serve` running at that URL?") from None
    for name, count in counts.items():
        print(f"{Path(args.outdir) / name}: {count} rows")
    return 0


def read_rows(path: Path, split: str | None, limit: int | None) -> list[Any]:
    """The rows of a rows file (``corral rows`` output), of ``split`` only when given;
    UsageError for a missing or malformed file, RunError when nothing is selected."""
    from corral.rollouts.rows import RowsError
    from corral.rollouts.rows import read_rows as read_chosen

    try:
        rows = read_chosen(rows_file(path), split=split, limit=limit)
    except (OSError, RowsError) as exc:
        raise UsageError(str(exc), "Pass a file written by `corral rows`.") from None
    if not rows:
        raise RunError(f"{path} has no rows" + (f" of split {split!r}" if split else ""))
    return rows


def cmd_eval(args: argparse.Namespace) -> int:
    import asyncio

    from rich.progress import Progress

    from corral.cli.harness import harness_options
    from corral.console import make_console, print_table
    from corral.rollouts.evals import report_table, write_eval

    harness = harness_options(args)
    rows = read_rows(Path(args.rows), args.split or None, args.limit)
    admin = token_from_env(args.admin_token_var, "--admin-token-var")
    env_token = token_from_env(rows[0].metadata.env.token_var, "the rows' env token")
    sampling = {"temperature": args.temperature} if args.temperature is not None else None
    asyncio.run(_probe(args.gateway, admin, args.admin_token_var))
    console = make_console()
    with Progress(console=console) as progress:
        bar = progress.add_task("episodes", total=len(rows) * args.n)
        report = asyncio.run(
            _eval(args, rows, admin, env_token, sampling, lambda _: progress.advance(bar), harness)
        )
    out = Path(args.out)
    write_eval(report, out)
    title = f"eval of {args.rows} ({args.split or 'all splits'}, n={args.n})"
    print_table(console, report_table(report, title))
    console.print(f"mean reward {report.overall.line()}; episodes in {out / 'episodes.jsonl'}")
    return 0


async def _probe(url: str, admin: str | None, token_var: str | None) -> None:
    from corral.gateway.client import GatewayAdmin

    async with GatewayAdmin(url, admin) as gateway:
        await probe_gateway(gateway, token_var)


async def _eval(
    args: argparse.Namespace,
    rows: list[Any],
    admin: str | None,
    env_token: str | None,
    sampling: dict[str, Any] | None,
    on_episode: Any,
    harness: Any = None,
) -> Any:
    """:func:`~corral.rollouts.evals.eval_rows`, its failures as CliErrors: the gateway's
    (unreachable, token refused), the env server's, a row's."""
    import httpx

    from corral.gateway.client import GatewayAdminError
    from corral.rollouts.evals import eval_rows
    from corral.rollouts.player import PlayerError
    from corral.rollouts.traces import TraceWriter

    try:
        return await eval_rows(
            rows,
            args.gateway,
            admin_token=admin,
            env_token=env_token,
            n=args.n,
            concurrency=args.concurrency,
            sampling=sampling,
            on_episode=on_episode,
            harness=harness,
            trace=TraceWriter(Path(args.out)),  # each episode's spans as it ends
        )
    except (PlayerError, httpx.HTTPError, ExceptionGroup) as exc:
        if (refused := first_of(exc, GatewayAdminError)) is not None:
            assert isinstance(refused, GatewayAdminError)
            raise gateway_error(refused, args.gateway, args.admin_token_var) from exc
        if (env := first_of(exc, httpx.HTTPError)) is not None:
            raise RunError(
                f"the rows' env server failed: {env}", "Is `corral serve` running at the rows' URL?"
            ) from exc
        if (player := first_of(exc, PlayerError)) is not None:
            raise RunError(str(player)) from exc
        raise


def _add_rows(sub: Any) -> None:
    rows = sub.add_parser(
        "rows",
        help="write an env server's tasks as training rows",
        description="Writes all.jsonl and one file per split: chat messages plus metadata "
        "(split, index, task id, tools, the server and rollout settings). Rows name the "
        "token's environment variable, never the token.",
    )
    rows.add_argument("url", help="the env server, e.g. http://127.0.0.1:8200")
    rows.add_argument("outdir", help="folder the rows files go to")
    rows.add_argument(
        "--max-turns", type=int, default=_ROWS.max_turns, help="model turns per episode"
    )
    rows.add_argument(
        "--tool-timeout", type=float, default=_ROWS.tool_timeout, help="seconds per tool call"
    )
    rows.add_argument(
        "--reset-timeout",
        type=float,
        default=_ROWS.reset_timeout,
        help="seconds an episode may take to start",
    )
    rows.add_argument(
        "--model-timeout", type=float, default=_ROWS.model_timeout, help="seconds per model call"
    )
    rows.add_argument("--token-var", metavar="NAME", help="environment variable with the token")
    rows.set_defaults(func=cmd_rows)


def _add_eval(sub: Any) -> None:
    ev = sub.add_parser(
        "eval",
        help="play a split's rows through the gateway and report the mean reward",
        description="Plays each row (n times) with the episode player through the gateway "
        "against the rows' env server, with a progress bar; prints the mean reward with its "
        "standard error (per group too when the bundle names [eval] group_by, e.g. gridsim's "
        "battery size); failed episodes are counted apart, never as 0. Writes every episode "
        "to OUT/episodes.jsonl and the summary to OUT/summary.json.",
    )
    ev.add_argument("rows", help="a rows file (JSONL), e.g. rows/eval.jsonl")
    ev.add_argument("--gateway", required=True, help="the gateway's URL")
    ev.add_argument("--admin-token-var", metavar="NAME", help="variable with the admin token")
    ev.add_argument("--split", default="eval", help="only rows of this split ('' for all)")
    ev.add_argument("--n", type=int, default=1, help="rollouts per task")
    ev.add_argument("--limit", type=int, help="at most this many rows")
    ev.add_argument("--concurrency", type=int, default=8, help="episodes at once")
    ev.add_argument("--temperature", type=float, help="override the sampling temperature")
    ev.add_argument("--out", default=".corral/eval", help="where episodes and summary go")
    from corral.rollouts.harness_play import add_harness_arguments

    add_harness_arguments(ev)
    ev.set_defaults(func=cmd_eval)


def add_rows_commands(sub: Any) -> None:
    """Add this module's subcommands to ``sub`` (the top parser's subparsers)."""
    _add_rows(sub)
    _add_eval(sub)
