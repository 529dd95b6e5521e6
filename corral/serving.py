"""Run ASGI apps with uvicorn in a background thread on 127.0.0.1 (tests, demos, benchmarks).

The server runs with corral's transport limits (:mod:`corral.transport`): no idle or slow
socket is held for ever, whichever app it serves.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from corral.transport import KEEP_ALIVE_S, TransportLimits, hardened_config

__all__ = ["KEEP_ALIVE_S", "free_port", "serve_in_thread"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the usual race applies)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_in_thread(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    limits: TransportLimits | None = None,
    **config: Any,
) -> Iterator[str]:
    """Serve ``app`` until the block exits; yield its base URL.

    ``limits`` bounds the transport (default: ``TransportLimits()``); other ``config`` goes
    to ``uvicorn.Config`` (the settings ``limits`` owns raise ``TypeError`` there).

    Returns once uvicorn listens (its ``started`` flag, waited on with an event, not a sleep);
    raises ``RuntimeError`` if the server thread dies first (e.g. the port is taken or the
    app's startup fails). On exit the server shuts down gracefully (lifespan shutdown runs).
    """
    port = port or free_port(host)
    server = uvicorn.Server(
        hardened_config(
            app,
            limits or TransportLimits(),
            host=host,
            port=port,
            log_level=config.pop("log_level", "warning"),
            timeout_graceful_shutdown=config.pop("timeout_graceful_shutdown", 2),
            **config,
        )
    )
    ready = threading.Event()
    original_startup = server.startup

    async def startup(sockets: Any = None) -> None:
        try:
            await original_startup(sockets=sockets)
        finally:
            ready.set()

    server.startup = startup  # type: ignore[method-assign]

    def run() -> None:
        try:
            server.run()
        finally:
            ready.set()

    thread = threading.Thread(target=run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    ready.wait()
    if not server.started:
        thread.join(timeout=5)
        raise RuntimeError(f"the server on {host}:{port} did not start")
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
