"""The settings a child server is started from (``EngineSettings``, ``GatewayLaunch``,
``ServeSettings``) and ``corral``'s real argument parser agree: every ``to_argv()`` parses, each
field comes back as the value the command hands its server, and default settings parse to the
CLI's own defaults. The CLI keeps its flags by hand for now: this test is what keeps the two in
step."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from corral.cli import build_parser
from corral.engines.local.settings import EngineSettings
from corral.envs.episodes import DEFAULT_MAX_CONCURRENT_ENVS
from corral.envs.server import DEFAULT_AGENT_MAX_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from corral.envs.settings import ServeSettings
from corral.gateway.launch import GatewayLaunch

LISTEN = ["--host", "127.0.0.1", "--port", "1"]  # what the launcher appends


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args([*argv, *LISTEN])


# --------------------------------------------------------------------------- the local engine


def engine_values(args: argparse.Namespace) -> dict[str, Any]:
    """What ``cmd_engine`` hands ``run_engine``, by EngineSettings field."""
    return {
        "model": Path(args.model),
        "device": args.device,
        "max_batch_size": args.max_batch_size,
        "token_var": args.token_var,
    }


@pytest.mark.parametrize(
    "settings",
    [
        EngineSettings(model=Path("/m/tiny")),
        EngineSettings(model=Path("/m/tiny"), device="cuda", max_batch_size=3),
        EngineSettings(model=Path("/m/tiny"), token_var="ENGINE_TOKEN"),
    ],
)
def test_engine_settings_round_trip_through_corral_engine(settings: EngineSettings) -> None:
    args = parse(settings.to_argv())
    assert args.command == "engine"
    assert engine_values(args) == vars(settings)


def test_engine_defaults_are_the_clis() -> None:
    args = parse(["engine", "--model", "/m/tiny"])
    assert engine_values(args) == vars(EngineSettings(model=Path("/m/tiny")))


def test_engine_settings_refuse_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineSettings(model=Path("/m"), max_batch_size=0)


# --------------------------------------------------------------------------- the gateway


def gateway_values(args: argparse.Namespace) -> dict[str, Any]:
    """What ``cmd_gateway`` hands ``create_gateway``, by GatewayLaunch field."""
    return {
        "engine_url": args.engine_url,
        "model": Path(args.model),
        "engine_api": args.engine_api,
        "admin_token_var": args.admin_token_var,
        "engine_token_var": args.engine_token_var,
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "chat_template_kwargs": args.chat_template_kwargs,
        "client_template_kwargs": frozenset(args.chat_template_kwargs_allow),
        "history": args.history,
        "max_sessions": args.max_sessions,
        "max_held_tokens": args.max_held_tokens,
        "session_ttl_s": args.session_ttl,
        "engine_timeout_s": args.engine_timeout,
        "journal_dir": args.journal,
        "journal_sync": args.journal_sync,
        "workers": args.workers,
        "served_model_name": args.served_model_name,
    }


@pytest.mark.parametrize(
    "launch",
    [
        GatewayLaunch(engine_url="http://e:1", model=Path("/m/tiny")),
        GatewayLaunch(
            engine_url="http://e:1,http://e:2",
            model=Path("/m/tiny"),
            engine_api="vllm",
            admin_token_var="ADMIN",
            engine_token_var="ENGINE",
            tool_call_parser="hermes",
            reasoning_parser="qwen3",
            chat_template_kwargs={"enable_thinking": False, "depth": [1, "x"]},
            client_template_kwargs=frozenset({"a", "b"}),
            history="template",
            max_sessions=3,
            max_held_tokens=1000,
            session_ttl_s=12.5,
            engine_timeout_s=42.0,
            journal_dir=Path("/j"),
            journal_sync="always",
            workers=3,
            served_model_name="policy",
        ),
        GatewayLaunch(
            engine_url="http://e:1", model=Path("/m"), client_template_kwargs=frozenset()
        ),
    ],
)
def test_gateway_launch_round_trips_through_corral_gateway(launch: GatewayLaunch) -> None:
    args = parse(launch.to_argv())
    assert args.command == "gateway"
    assert gateway_values(args) == vars(launch)


def test_gateway_defaults_are_the_clis() -> None:
    args = parse(["gateway", "--engine-url", "http://e:1", "--model", "/m/tiny"])
    assert gateway_values(args) == vars(
        GatewayLaunch(engine_url="http://e:1", model=Path("/m/tiny"))
    )


def test_gateway_options_are_create_gateways_keywords() -> None:
    """The in-thread form hands create_gateway the same values a child's flags give it."""
    launch = GatewayLaunch(engine_url="http://e:1", model=Path("/m"), served_model_name="p")
    options = launch.gateway_options()
    assert options["model_name"] == "p" and options["engine_api"] == "sglang"
    assert "served_model_name" not in options and "admin_token_var" not in options


# --------------------------------------------------------------------------- the env server


def serve_values(args: argparse.Namespace) -> dict[str, Any]:
    """What ``cmd_serve`` hands ``build_app``, by ServeSettings field (the server's defaults
    where a field is None)."""
    return {
        "bundle": Path(args.bundle),
        "token_var": args.token_var,
        "max_concurrent_envs": args.max_concurrent_envs,
        "reset_timeout": args.reset_timeout,
        "idle_timeout": args.idle_timeout,
        "tool_timeout": args.tool_timeout,
        "first_reset_timeout": args.first_reset_timeout,
        "sandbox": args.sandbox,
        "sandbox_image": args.sandbox_image,
        "warm_sandboxes": args.warm_sandboxes,
        "max_body_bytes": args.max_body_bytes,
        "agent_clis": None if args.agent_clis is None else Path(args.agent_clis),
        "agent_gateways": tuple(args.agent_gateway),
        "agent_max_timeout_s": args.agent_max_timeout,
    }


SERVER_DEFAULTS = {
    "max_concurrent_envs": DEFAULT_MAX_CONCURRENT_ENVS,
    "max_body_bytes": DEFAULT_MAX_BODY_BYTES,
    "agent_max_timeout_s": DEFAULT_AGENT_MAX_TIMEOUT_S,
}


def with_server_defaults(settings: ServeSettings) -> dict[str, Any]:
    values = vars(settings).copy()
    for key, default in SERVER_DEFAULTS.items():
        if values[key] is None:
            values[key] = default
    return values


@pytest.mark.parametrize(
    "settings",
    [
        ServeSettings(bundle=Path("/b/gridsim")),
        ServeSettings(
            bundle=Path("/b/gridsim"),
            token_var="ENV_TOKEN",
            max_concurrent_envs=300,
            reset_timeout=5.0,
            idle_timeout=6.5,
            tool_timeout=7.25,
            first_reset_timeout=8.0,
            sandbox="bwrap",
            sandbox_image="img:1",
            warm_sandboxes=2,
            max_body_bytes=4096,
            agent_clis=Path("/clis"),
            agent_gateways=("http://10.0.0.1:8000", "http://10.0.0.2:8000"),
            agent_max_timeout_s=7200.0,
        ),
    ],
)
def test_serve_settings_round_trip_through_corral_serve(settings: ServeSettings) -> None:
    args = parse(settings.to_argv())
    assert args.command == "serve"
    assert serve_values(args) == with_server_defaults(settings)


def test_serve_defaults_are_the_clis() -> None:
    args = parse(["serve", "/b/gridsim"])
    assert serve_values(args) == with_server_defaults(ServeSettings(bundle=Path("/b/gridsim")))


def test_serve_app_options_are_build_apps_keywords() -> None:
    """The in-thread form hands build_app every keyword it names, the server's defaults kept
    for the fields left None; the token is the caller's."""
    import inspect

    from corral.envs.server import build_app

    options = ServeSettings(bundle=Path("/b")).app_options()
    assert not set(SERVER_DEFAULTS) & set(options)
    full = ServeSettings(bundle=Path("/b"), max_concurrent_envs=2, max_body_bytes=3).app_options()
    assert set(full) < set(inspect.signature(build_app).parameters) - {"bundle", "token"}
