"""``corral engine``, ``corral gateway`` and ``corral serve``: the three servers, each run in the
foreground until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from corral.cli.checks import bundle_folder, model_folder
from corral.cli.errors import RunError, UsageError
from corral.cli.options import (
    add_rendering_flags,
    add_transport_flags,
    listening,
    name_list,
    token_from_env,
    transport_limits,
)
from corral.envs.server import DEFAULT_AGENT_MAX_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from corral.envs.settings import (
    AGENT_CLIS_VARIABLE,
    FIRST_RESET_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    RESET_TIMEOUT_S,
    TOOL_TIMEOUT_S,
)
from corral.gateway.settings import (
    DEFAULT_CLIENT_TEMPLATE_KWARGS,
    HISTORY_MODES,
    JOURNAL_SYNCS,
    GatewaySettings,
)
from corral.sandboxes.base import SandboxError
from corral.sandboxes.providers import BACKENDS


def cmd_engine(args: argparse.Namespace) -> int:
    from corral.engines.local.settings import is_loopback

    # Both before torch is imported: a wrong invocation fails at once.
    token = token_from_env(args.token_var, "--token-var")
    if token is None and not is_loopback(args.host):
        raise UsageError(
            f"--host {args.host} without --token-var: anyone who reaches the port could abort "
            "every request and swap the weights",
            "Name the token's variable with --token-var, or listen on 127.0.0.1.",
        )
    model = model_folder(args.model)
    from corral.engines.local.server import run_engine

    with listening(args.host, args.port):
        run_engine(
            model,
            host=args.host,
            port=args.port,
            device=args.device,
            max_batch_size=args.max_batch_size,
            token=token,
        )
    return 0


def _gateway_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of ``create_gateway`` (after the engine URL and the model) the flags ask
    for, tokens aside: the flags read as the :class:`GatewayLaunch` they spell (its
    ``to_argv`` is their inverse), so the flag-to-setting mapping is written once."""
    from corral.gateway.launch import GatewayLaunch

    launch = GatewayLaunch(
        engine_url=args.engine_url,
        model=Path(args.model),
        engine_api=args.engine_api,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template_kwargs=args.chat_template_kwargs,
        client_template_kwargs=frozenset(args.chat_template_kwargs_allow),
        history=args.history,
        max_sessions=args.max_sessions,
        max_held_tokens=args.max_held_tokens,
        session_ttl_s=args.session_ttl,
        engine_timeout_s=args.engine_timeout,
        journal_dir=args.journal,
        journal_sync=args.journal_sync,
        workers=args.workers,
        served_model_name=args.served_model_name or None,
    )
    return launch.gateway_options()


def _claim_journal(journal: Path | None, workers: int) -> None:
    """Refuse a journal folder written with another ``--workers``; mark a new one."""
    if journal is None:
        return
    from corral.gateway.workers import JournalLayoutError, claim_journal

    try:
        claim_journal(journal, workers)
    except JournalLayoutError as exc:
        raise UsageError(str(exc)) from None


def cmd_gateway(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    admin_token = token_from_env(args.admin_token_var, "--admin-token-var")
    engine_token = token_from_env(args.engine_token_var, "--engine-token-var")
    model = model_folder(args.model)
    if admin_token is None:  # warned only once nothing stops the gateway from starting
        token_from_env(
            None,
            "--admin-token-var",
            open_warning="session management is open to anyone who can reach this port",
        )
    _claim_journal(args.journal, args.workers)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.workers > 1:
        return _gateway_workers(args, model, admin_token, engine_token)
    from corral.gateway.journal import JournalError
    from corral.gateway.server import create_gateway
    from corral.serving import serve_forever

    try:
        app = create_gateway(
            args.engine_url,
            model,
            admin_token=admin_token,
            engine_token=engine_token,
            **_gateway_options(args),
        )
    except JournalError as exc:  # a damaged journal, or a folder it cannot use
        raise RunError(str(exc)) from None
    # No per-request access log by default: on the hot path it costs more than the gateway.
    with listening(args.host, args.port):
        serve_forever(
            app,
            host=args.host,
            port=args.port,
            limits=transport_limits(args),
            log_level=args.log_level,
            access_log=args.access_log,
        )
    return 0


def _gateway_workers(
    args: argparse.Namespace, model: Path, admin_token: str | None, engine_token: str | None
) -> int:
    """``--workers N`` (N > 1): this process binds the address and supervises N worker
    processes serving it (corral.gateway.workers); it loads no model itself."""
    import dataclasses

    from corral.gateway.workers import WorkerSpec, json_options, run_workers
    from corral.serving import bind_socket

    spec = WorkerSpec(
        index=0,
        workers=args.workers,
        listen_fd=-1,
        parent_fd=-1,
        host=args.host,
        port=args.port,
        socket_dir="",
        secret="",
        engine_url=args.engine_url,
        model=str(model),
        options=json_options(_gateway_options(args)),
        admin_token=admin_token,
        engine_token=engine_token,
        limits=dataclasses.asdict(transport_limits(args)),
        log_level=args.log_level,
        access_log=args.access_log,
    )
    with listening(args.host, args.port):
        listener = bind_socket(args.host, args.port)
    try:
        bound = int(listener.getsockname()[1])
        return run_workers(dataclasses.replace(spec, port=bound), listener)
    finally:
        listener.close()


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
    with listening(args.host, args.port):
        run_server(
            app,
            host=args.host,
            port=args.port,
            log_level="info",
            access_log=False,
            limits=transport_limits(args),
        )
    return 0


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
    engine.add_argument(
        "--token-var",
        metavar="NAME",
        help="environment variable holding the bearer token every route but /health requires "
        "(SGLang's --api-key header); required to listen beyond loopback",
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
    gateway.add_argument(
        "--engine-token-var",
        metavar="NAME",
        help="environment variable holding the engines' bearer token (corral engine "
        "--token-var, SGLang's or vLLM's --api-key), sent on every engine request",
    )
    add_rendering_flags(gateway)
    gateway.add_argument(
        "--chat-template-kwargs-allow",
        type=name_list,
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
    gateway.add_argument(
        "--engine-timeout",
        type=float,
        default=GatewaySettings.engine_timeout_s,
        metavar="S",
        help="seconds an engine request may take (a streamed one: between outputs)",
    )
    gateway.add_argument(
        "--journal",
        type=Path,
        metavar="DIR",
        help="append every session's turns and events to a journal in DIR; a gateway started "
        "on the same DIR goes on with every live session",
    )
    gateway.add_argument(
        "--journal-sync",
        choices=JOURNAL_SYNCS,
        default=GatewaySettings.journal_sync,
        help="when journal writes are made durable: always (before each answer goes out), "
        "interval (every second) or never (when the OS decides); a killed gateway loses "
        "nothing under any of them, a crashed machine what was not yet synced",
    )
    gateway.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="worker processes behind the one address, each owning the sessions it creates",
    )
    gateway.add_argument("--access-log", action="store_true", help="log every request")
    add_transport_flags(gateway)
    gateway.set_defaults(func=cmd_gateway)


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


def add_server_commands(sub: Any) -> None:
    """Add this module's subcommands to ``sub`` (the top parser's subparsers)."""
    _add_serve(sub)
    _add_engine(sub)
    _add_gateway(sub)
