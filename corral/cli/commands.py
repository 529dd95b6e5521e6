"""The subcommands besides training and ``corral play``: their arguments and a plain function
each. Heavy imports (torch, transformers, uvicorn) happen inside the command that needs them.

A command returns its exit code, or raises a :class:`~corral.cli.errors.CliError` that
:func:`corral.cli.main` prints as one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from corral.cli.checks import bundle_folder, gateway_error, model_folder, probe_gateway, rows_file
from corral.cli.errors import RunError, UsageError, first_of
from corral.envs.playcheck import DEFAULT_MARGIN, DEFAULT_SEED, DEFAULT_TASKS
from corral.envs.server import DEFAULT_AGENT_MAX_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from corral.envs.settings import (
    FIRST_RESET_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    RESET_TIMEOUT_S,
    TOOL_TIMEOUT_S,
)
from corral.gateway.parsers.reasoning import reasoning_parser_names
from corral.gateway.parsers.tool_calls import tool_call_parser_names
from corral.gateway.settings import (
    DEFAULT_CLIENT_TEMPLATE_KWARGS,
    HISTORY_MODES,
    GatewaySettings,
)
from corral.rollouts.rows import RowSettings
from corral.sandboxes.base import SandboxError
from corral.sandboxes.image import DEFAULT_TAG
from corral.sandboxes.providers import BACKENDS

# Where a default lives in the component, the flag takes it from there.
_ROWS = RowSettings()


def _name_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if "chat_template" in names:
        raise argparse.ArgumentTypeError("clients can never replace the chat template")
    return names


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def token_from_env(var: str | None, what: str, *, open_warning: str | None = None) -> str | None:
    """Secrets come from the environment variable a flag names, never from the command line.

    With no variable named, ``open_warning`` (what is left open) goes to stderr; a variable
    named but unset or empty is a UsageError.
    """
    import sys

    from corral.env_secrets import SecretMissing, env_secret

    if var is None and open_warning is not None:
        print(f"corral: no {what}: {open_warning}", file=sys.stderr)
    try:
        return env_secret(var, what)
    except SecretMissing as exc:
        raise UsageError(str(exc), f"Export {var} or name another variable.") from None


def cmd_model_tiny(args: argparse.Namespace) -> int:
    from corral.engines.tiny_model import build_tiny_model

    out = build_tiny_model(
        Path(args.out),
        template=args.template,
        seed=args.seed,
        imprint=not args.no_imprint,
        size=args.size,
    )
    print(out)
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    model = model_folder(args.model)  # before torch is imported: a wrong path fails at once
    from corral.engines.local.server import run_engine

    run_engine(
        model,
        host=args.host,
        port=args.port,
        device=args.device,
        max_batch_size=args.max_batch_size,
    )
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    admin_token = token_from_env(args.admin_token_var, "--admin-token-var")
    model = model_folder(args.model)
    if admin_token is None:  # warned only once nothing stops the gateway from starting
        token_from_env(
            None,
            "--admin-token-var",
            open_warning="session management is open to anyone who can reach this port",
        )
    import uvicorn

    from corral.gateway.server import create_gateway
    from corral.transport import hardened_config

    app = create_gateway(
        args.engine_url,
        model,
        engine_api=args.engine_api,
        admin_token=admin_token,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template_kwargs=args.chat_template_kwargs,
        client_template_kwargs=frozenset(args.chat_template_kwargs_allow),
        history=args.history,
        max_sessions=args.max_sessions,
        max_held_tokens=args.max_held_tokens,
        session_ttl_s=args.session_ttl,
        **({"model_name": args.served_model_name} if args.served_model_name else {}),
    )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # No per-request access log by default: on the hot path it costs more than the gateway.
    config = hardened_config(
        app,
        transport_limits(args),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
    )
    uvicorn.Server(config).run()
    return 0


# Where `corral serve` finds the agent CLIs when --agent-clis is not given.
AGENT_CLIS_VARIABLE = "CORRAL_AGENT_CLIS"


def _agent_clis(flag: str | None) -> Path | None:
    """--agent-clis, else $CORRAL_AGENT_CLIS when set (and not empty), else none."""
    chosen = flag or os.environ.get(AGENT_CLIS_VARIABLE) or None
    return Path(chosen) if chosen is not None else None


def cmd_serve(args: argparse.Namespace) -> int:
    bundle = bundle_folder(args.bundle)
    from corral.envs.running import run_server
    from corral.envs.server import build_app

    token = token_from_env(
        args.token_var,
        "--token-var",
        open_warning="every route and episode is open to anyone who can reach this port",
    )
    try:
        app = build_app(
            bundle,
            max_concurrent_envs=args.max_concurrent_envs,
            token=token,
            reset_timeout=args.reset_timeout,
            idle_timeout=args.idle_timeout,
            tool_timeout=args.tool_timeout,
            sandbox=args.sandbox,
            sandbox_image=args.sandbox_image,
            warm_sandboxes=args.warm_sandboxes,
            first_reset_timeout=args.first_reset_timeout,
            max_body_bytes=args.max_body_bytes,
            agent_clis=_agent_clis(args.agent_clis),
            agent_gateways=args.agent_gateway,
            agent_max_timeout_s=args.agent_max_timeout,
        )
    except SandboxError as exc:
        # The machine lacks what the backend needs (one line per missing piece): a runtime
        # problem, not a wrong invocation.
        raise RunError("; ".join(str(exc).splitlines())) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # SIGTERM: new episodes are refused, live ones are closed (1001 with a reason) and torn
    # down, and the process exits 0; the server pings sockets every 20 s.
    run_server(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        access_log=False,
        limits=transport_limits(args),
    )
    return 0


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


def cmd_sandbox_image_build(args: argparse.Namespace) -> int:
    from corral.sandboxes.image import build_image, inputs_hash

    try:
        built = build_image(args.tag, force=args.force)
    except RuntimeError as exc:
        raise RunError(str(exc)) from None
    print(f"{args.tag}: {'built' if built else 'cached'} (inputs {inputs_hash()})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from corral.run import DEFAULT_BUNDLE, TRAINED_GRIDSIM_POLICY, PolicyMissing, run_main_job

    bundle = Path(args.bundle) if args.bundle else DEFAULT_BUNDLE
    # The trained policy plays gridsim only: another bundle gets it only when asked for; a
    # checkout without the committed model still runs the rest.
    policy = Path(args.policy) if args.policy else None
    default = TRAINED_GRIDSIM_POLICY
    if policy is None and bundle.resolve() == DEFAULT_BUNDLE.resolve():
        policy = default if (default / "config.json").is_file() else None
    if not (bundle / "bundle.toml").exists():
        raise UsageError(f"no bundle at {bundle} (pass --bundle PATH)")
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


def add_core_commands(sub: Any) -> None:
    """Add every subcommand of this module to ``sub`` (the top parser's subparsers)."""
    _add_run(sub)
    _add_model(sub)
    _add_serve(sub)
    _add_rows(sub)
    _add_eval(sub)
    _add_bundle(sub)
    _add_sandbox(sub)
    _add_engine(sub)
    _add_gateway(sub)
    _add_template(sub)


def _add_run(sub: Any) -> None:
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


def _add_model(sub: Any) -> None:
    model = sub.add_parser(
        "model", help="build models", description="Build models offline."
    ).add_subparsers(dest="model_command", required=True, metavar="KIND")
    tiny = model.add_parser(
        "tiny",
        help="build the tiny offline chat model (Hugging Face format)",
        description="A byte-level BPE tokenizer, a ChatML tool-calling template and small "
        "random Qwen2 weights, imprinted with the tool-call format. Offline, in seconds.",
    )
    tiny.add_argument("out", help="output folder")
    tiny.add_argument(
        "--template",
        choices=["qwen25", "qwen3"],
        default="qwen25",
        help="qwen3 drops earlier <think> blocks from history (to exercise drift)",
    )
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.add_argument("--no-imprint", action="store_true", help="random weights only")
    tiny.add_argument(
        "--size",
        choices=["tiny", "vllm"],
        default="tiny",
        help="vllm: hidden 128, 2 heads of dimension 64 (vLLM's CPU attention needs >= 32)",
    )
    tiny.set_defaults(func=cmd_model_tiny)


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve an env bundle over HTTP + WebSocket",
        description="Episodes over a WebSocket (OpenEnv's message shapes plus corral's "
        "extensions), a task API and /metrics. Plain HTTP: put a TLS-terminating proxy in "
        "front of it to expose it beyond the machine. Without --sandbox a bundle that needs "
        "none runs in this process. With --sandbox every episode's env runs in a sandbox of "
        "its own: bwrap (namespaces, seccomp, cgroup limits) or docker (a container, network "
        "none) isolate it; kubernetes and e2b run it remotely; 'local' is a plain subprocess "
        "in a temporary folder with NO isolation, for development only. The verifier always "
        "runs in this process.",
    )
    serve.add_argument("bundle", help="the bundle folder (it holds bundle.toml)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8200, help="port to listen on")
    serve.add_argument(
        "--token-var", metavar="NAME", help="environment variable holding the bearer token"
    )
    serve.add_argument(
        "--max-concurrent-envs", type=int, default=64, help="episodes live at once (the rest wait)"
    )
    serve.add_argument(
        "--reset-timeout",
        type=float,
        default=RESET_TIMEOUT_S,
        help="seconds an episode may take to start",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=IDLE_TIMEOUT_S,
        help="seconds idle before an episode is reaped",
    )
    serve.add_argument(
        "--tool-timeout", type=float, default=TOOL_TIMEOUT_S, help="seconds a tool call may take"
    )
    serve.add_argument(
        "--sandbox",
        choices=list(BACKENDS),
        default=None,
        help="run each episode's env in a sandbox of this backend ('local': NO isolation)",
    )
    serve.add_argument(
        "--sandbox-image", metavar="IMAGE", help="docker/kubernetes image or e2b template"
    )
    serve.add_argument(
        "--warm-sandboxes", type=int, default=0, metavar="N", help="keep N sandboxes started"
    )
    serve.add_argument(
        "--first-reset-timeout",
        type=float,
        default=FIRST_RESET_TIMEOUT_S,
        metavar="S",
        help="seconds a new WebSocket has to send its first reset",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="largest HTTP request body (reset, step, /mcp; beyond: 413)",
    )
    serve.add_argument(
        "--agent-clis",
        metavar="DIR",
        help="the npm install of the agent CLIs (scripts/agent_clis.sh DIR), handed read-only "
        "to every bwrap or docker sandbox for black-box agents (claude, codex on PATH); "
        f"default: ${AGENT_CLIS_VARIABLE} when set, else none (only command agents run)",
    )
    serve.add_argument(
        "--agent-gateway",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a gateway origin (scheme://host:port) black-box agents may reach (repeatable); "
        "default: loopback origins only",
    )
    serve.add_argument(
        "--agent-max-timeout",
        type=float,
        default=DEFAULT_AGENT_MAX_TIMEOUT_S,
        metavar="S",
        help="the longest budget a black-box agent's launch may ask for, in seconds",
    )
    add_transport_flags(serve)
    serve.set_defaults(func=cmd_serve)


def add_transport_flags(parser: argparse.ArgumentParser) -> None:
    """Options for the bounds a server's transport enforces (:mod:`corral.transport`); the
    defaults are :class:`~corral.transport.TransportLimits`'s."""
    from corral.transport import TransportLimits

    defaults = TransportLimits()
    group = parser.add_argument_group("transport limits (idle, slow and excess connections)")
    group.add_argument(
        "--head-timeout",
        type=float,
        default=defaults.head_timeout_s,
        metavar="S",
        help="seconds a connection has to send a request's headers",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=defaults.body_timeout_s,
        metavar="S",
        help="seconds a request's body has to arrive after its headers",
    )
    group.add_argument(
        "--max-pending-connections",
        type=int,
        default=defaults.max_pending,
        metavar="N",
        help="connections still sending a request (beyond: the oldest is dropped)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        metavar="N",
        help="other connections (beyond: the longest idle is closed, else 503)",
    )
    group.add_argument(
        "--ws-max-size",
        type=int,
        default=defaults.ws_max_size,
        metavar="BYTES",
        help="largest WebSocket message (beyond: close 1009)",
    )


def transport_limits(args: argparse.Namespace) -> Any:
    """The :class:`~corral.transport.TransportLimits` the transport flags ask for."""
    from corral.transport import TransportLimits

    try:
        return TransportLimits(
            head_timeout_s=args.head_timeout,
            body_timeout_s=args.body_timeout,
            max_pending=args.max_pending_connections,
            max_connections=args.max_connections,
            ws_max_size=args.ws_max_size,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


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


def _add_bundle(sub: Any) -> None:
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


def _add_sandbox(sub: Any) -> None:
    sandbox = sub.add_parser(
        "sandbox", help="sandbox backends", description="Sandbox backends."
    ).add_subparsers(dest="sandbox_command", required=True, metavar="ACTION")
    image = sandbox.add_parser(
        "image", help="the docker sandbox image", description="The docker sandbox image."
    ).add_subparsers(dest="image_command", required=True, metavar="ACTION")
    build = image.add_parser(
        "build",
        help="build the docker sandbox image without a registry (debootstrap + docker import)",
        description="Debootstraps a minimal Debian root with python3 and imports it into the "
        "daemon DOCKER_HOST names. Cached: an image whose input-hash label matches is reused. "
        "Needs root, debootstrap, docker and a Debian mirror (CORRAL_DEBIAN_MIRROR).",
    )
    build.add_argument("--tag", default=DEFAULT_TAG, help="the image's name:tag")
    build.add_argument("--force", action="store_true", help="rebuild even when cached")
    build.set_defaults(func=cmd_sandbox_image_build)


def _add_engine(sub: Any) -> None:
    engine = sub.add_parser(
        "engine",
        help="serve a model with the local engine (SGLang's native API; not SGLang)",
        description="A transformers model behind SGLang's native API (/generate, "
        "/abort_request, /update_weights_from_disk, ...). For CPU, tests and small runs; use "
        "SGLang itself for real serving.",
    )
    engine.add_argument(
        "--model", required=True, help="a local Hugging Face model folder (config.json, weights)"
    )
    engine.add_argument("--host", default="127.0.0.1", help="address to listen on")
    engine.add_argument("--port", type=int, default=30000, help="port to listen on")
    engine.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs"
    )
    engine.add_argument(
        "--max-batch-size", type=int, default=64, help="requests decoded together (the rest wait)"
    )
    engine.set_defaults(func=cmd_engine)


def _add_gateway(sub: Any) -> None:
    gateway = sub.add_parser(
        "gateway",
        help="serve the OpenAI chat gateway in front of an SGLang-API engine",
        description="OpenAI chat completions per session; every turn is recorded as exact "
        "training tokens (GET /sessions/{id}/samples).",
    )
    gateway.add_argument(
        "--engine-url",
        required=True,
        help="the engine: an SGLang server, a router in front of several, corral's local "
        "engine, or vLLM (--engine-api vllm); several, comma-separated: each session goes to "
        "one of them (rendezvous hashing of its id)",
    )
    gateway.add_argument(
        "--engine-api",
        choices=["sglang", "vllm"],
        default="sglang",
        help="the engine's API: SGLang's native one (SGLang, its router, corral engine) or "
        "vLLM's token API (vLLM started with --enable-scale-out)",
    )
    gateway.add_argument(
        "--model", required=True, help="local Hugging Face folder with the tokenizer + template"
    )
    gateway.add_argument("--host", default="127.0.0.1", help="address to listen on")
    gateway.add_argument("--port", type=int, default=8000, help="port to listen on")
    gateway.add_argument(
        "--admin-token-var",
        metavar="NAME",
        help="environment variable holding the admin token for session management",
    )
    _add_rendering_flags(gateway)
    gateway.add_argument(
        "--chat-template-kwargs-allow",
        type=_name_list,
        default=sorted(DEFAULT_CLIENT_TEMPLATE_KWARGS),
        metavar="NAMES",
        help="comma-separated template variables clients may set per request "
        "(chat_template_kwargs); default: enable_thinking. The template itself is never "
        "the client's",
    )
    gateway.add_argument(
        "--history",
        choices=HISTORY_MODES,
        default=GatewaySettings.history,
        help="how a turn's prompt is built: tokens (the session's held tokens plus the new "
        "messages: one sample per episode whatever the template does to history) or template "
        "(the whole conversation rendered each turn); a session may choose its own",
    )
    gateway.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="level of corral's and uvicorn's loggers",
    )
    gateway.add_argument("--served-model-name", help="model name in answers (default: folder)")
    gateway.add_argument(
        "--max-sessions",
        type=int,
        default=GatewaySettings.max_sessions,
        help="sessions held at once (more: 429)",
    )
    gateway.add_argument(
        "--max-held-tokens",
        type=int,
        default=GatewaySettings.max_held_tokens,
        help="tokens all sessions may hold together (more: 429)",
    )
    gateway.add_argument(
        "--session-ttl",
        type=float,
        default=GatewaySettings.session_ttl_s,
        help="seconds idle before a session is dropped",
    )
    gateway.add_argument("--access-log", action="store_true", help="log every request")
    add_transport_flags(gateway)
    gateway.set_defaults(func=cmd_gateway)


def _add_rendering_flags(parser: argparse.ArgumentParser) -> None:
    """How the model's turns are rendered and read back: the gateway's flags, which
    ``template check`` takes too."""
    parser.add_argument(
        "--tool-call-parser",
        choices=tool_call_parser_names(),
        default=GatewaySettings.tool_call_parser,
        metavar="NAME",
        help="how the model writes tool calls: " + ", ".join(tool_call_parser_names()),
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=reasoning_parser_names(),
        default=GatewaySettings.reasoning_parser,
        metavar="NAME",
        help="how the model marks its reasoning: " + ", ".join(reasoning_parser_names()),
    )
    parser.add_argument(
        "--chat-template-kwargs",
        type=_json_object,
        default={},
        help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'",
    )


def _add_template(sub: Any) -> None:
    template = sub.add_parser(
        "template", help="chat templates", description="Check a model's chat template."
    ).add_subparsers(dest="template_command", required=True, metavar="ACTION")
    check = template.add_parser(
        "check",
        help="whether the gateway records a model's sessions as one sample each",
        description="Plays synthetic multi-turn conversations (chat with and without a system "
        "prompt, tool-call loops, parallel calls, a tool error, reasoning on and off, a long "
        "history) with the template standing in for the model, under both history modes: "
        "how many samples each merges into and why each fork happens, which boundary token "
        "history finds or why it falls back, and whether the parsers read back the calls and "
        "reasoning. Prints a table per mode and a verdict; exits 0 when nothing breaks under "
        "--history, 1 with a FAIL line per broken shape on stderr.",
    )
    check.add_argument("model_dir", metavar="MODEL_DIR", help="a local Hugging Face model folder")
    _add_rendering_flags(check)
    check.add_argument(
        "--history",
        choices=HISTORY_MODES,
        default=GatewaySettings.history,
        help="the history mode the verdict is for (the gateway's --history)",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=cmd_template_check)


def cmd_template_check(args: argparse.Namespace) -> int:
    import sys

    model = model_folder(args.model_dir, "MODEL_DIR")
    from corral.console import make_console, print_table
    from corral.gateway.rendering import TemplateError
    from corral.gateway.template_check import check_model_dir

    try:
        report = check_model_dir(
            model,
            history=args.history,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            chat_template_kwargs=args.chat_template_kwargs,
        )
    except TemplateError as exc:
        raise UsageError(f"{model}: {exc}", "Pass a model folder with a chat template.") from None
    failed = [s for s in report.shapes if s.breaks(report.history)]
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console = make_console()
        for table in _template_tables(report):
            print_table(console, table)
        played = sum(1 for s in report.shapes if s.skipped is None)
        verdict = (
            f"ok: no shape breaks under {report.history} history ({played} played)"
            if not failed
            else f"BREAK: {len(failed)} of {played} shapes break under {report.history} "
            f"history ({', '.join(s.name for s in failed)})"
        )
        console.print(f"{args.model_dir}: {verdict}", markup=False, highlight=False)
    for shape in failed:
        reasons = "; ".join(shape.breaks(report.history))
        print(f"{args.model_dir}: FAIL {shape.name}: {reasons}", file=sys.stderr)
    return 1 if failed else 0


def _template_tables(report: Any) -> list[Any]:
    """A table per history mode (the verdict's first): each shape's samples, whether every
    turn extends the last, whether the parsers read the outputs back, and a note."""
    from rich.markup import escape
    from rich.table import Table

    def mark(good: bool) -> str:
        return "yes" if good else "[bold red]no[/bold red]"

    tables = []
    for history in sorted(HISTORY_MODES, key=lambda mode: mode != report.history):
        chosen = " (the verdict's)" if history == report.history else ""
        table = Table(title=f"{report.model}: {history} history{chosen}")
        for column in ("shape", "turns", "samples", "extends?", "parser ok?", "note"):
            table.add_column(column, justify="right" if column in ("turns", "samples") else "left")
        for shape in report.shapes:
            check = shape.under(history)
            if check is None:
                why = shape.skipped or shape.unrenderable or ""
                note = f"skipped: {why}" if shape.skipped else f"[bold red]{escape(why)}[/]"
                table.add_row(shape.name, str(shape.turns), "-", "-", "-", note)
                continue
            forks = sum(1 for t in check.turns if t.forks)
            problems = shape.breaks(history)
            table.add_row(
                shape.name,
                str(shape.turns),
                str(check.samples),
                "yes"
                if not forks
                else f"[bold red]no[/bold red] ({forks} fork{'s' * (forks > 1)})",
                mark(not shape.parser_misses),
                escape(problems[0]) if problems else _boundaries(check),
            )
        tables.append(table)
    return tables


def _boundaries(check: Any) -> str:
    """How token history continued each turn (``prefix 2, isolated 1``); append-only else."""
    if check.history != "tokens":
        return "every prompt extends the last"
    counts: dict[str, int] = {}
    for turn in check.turns:
        if turn.boundary is not None:
            counts[turn.boundary] = counts.get(turn.boundary, 0) + 1
    return ", ".join(f"{name} {n}" for name, n in counts.items()) or "one turn"
