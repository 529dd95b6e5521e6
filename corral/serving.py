"""Run ASGI apps with uvicorn in a background thread on 127.0.0.1 (tests, demos, benchmarks)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

# How long a server keeps an idle keep-alive connection: longer than its clients keep one
# (httpx: 5 s). With equal timeouts a client can send a request on a connection the server is
# closing that instant, and the request fails with a ReadError (seen at 256 concurrent rollouts
# through the gateway); this way the client always closes an idle connection first.
KEEP_ALIVE_S = 75


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the usual race applies)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_in_thread(
    app: Any, *, host: str = "127.0.0.1", port: int | None = None, **config: Any
) -> Iterator[str]:
    """Serve ``app`` until the block exits; yield its base URL.

    Returns once uvicorn listens (its ``started`` flag, waited on with an event, not a sleep);
    raises ``RuntimeError`` if the server thread dies first (e.g. the port is taken or the
    app's startup fails). On exit the server shuts down gracefully (lifespan shutdown runs).
    """
    port = port or free_port(host)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=config.pop("log_level", "warning"),
            timeout_graceful_shutdown=config.pop("timeout_graceful_shutdown", 2),
            timeout_keep_alive=config.pop("timeout_keep_alive", KEEP_ALIVE_S),
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
