"""Flags and argument types more than one command takes: secrets from named variables, a
server's transport limits, the gateway's rendering options (which ``template check`` takes too)."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import Any

from corral.cli.errors import RunError, UsageError
from corral.gateway.parsers.reasoning import reasoning_parser_names
from corral.gateway.parsers.tool_calls import tool_call_parser_names
from corral.gateway.settings import (
    GatewaySettings,
)


def name_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if "chat_template" in names:
        raise argparse.ArgumentTypeError("clients can never replace the chat template")
    return names


def json_object(text: str) -> dict[str, Any]:
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


def add_rendering_flags(parser: argparse.ArgumentParser) -> None:
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
        type=json_object,
        default={},
        help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'",
    )


@contextlib.contextmanager
def listening(host: str, port: int) -> Iterator[None]:
    """A server command's body: a port that cannot be bound becomes one line, ``cannot listen
    on HOST:PORT: why``, with the fix (:class:`~corral.serving.BindError` as a RunError)."""
    from corral.serving import BindError

    try:
        yield
    except BindError as exc:
        raise RunError(str(exc), "Pass another --port, or stop what listens there.") from None
