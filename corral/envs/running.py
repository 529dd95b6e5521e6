"""Run an env server app with uvicorn until SIGINT / SIGTERM (:func:`run_server`)."""

from __future__ import annotations

from fastapi import FastAPI

from corral.envs.episodes import EpisodeManager
from corral.transport import TransportLimits

# The bound on uvicorn's graceful shutdown, used by run_server.
GRACEFUL_SHUTDOWN_S = 10


def run_server(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 8200,
    log_level: str = "info",
    access_log: bool = False,
    timeout_graceful_shutdown: int = GRACEFUL_SHUTDOWN_S,
    limits: TransportLimits | None = None,
) -> None:
    """Run an app from :func:`build_app` with uvicorn until SIGINT / SIGTERM (blocks).

    On the signal, before uvicorn's own graceful shutdown, the app's manager shuts down: new
    episodes are refused, every socket is closed with 1001 and a reason, every episode is torn
    down. uvicorn then waits at most ``timeout_graceful_shutdown`` s for requests in flight
    (e.g. a tool call in a worker thread) before cancelling them.

    ``limits`` (default ``TransportLimits()``) bounds the transport: how long a connection may
    take to send a request head and body, how many may wait for one, how many may be open in
    all, the largest WebSocket message, and the WebSocket ping keepalive (every socket is
    pinged each ``ws_ping_interval`` s and dropped if it does not answer within
    ``ws_ping_timeout`` s). See :mod:`corral.transport`.

    A SIGTERM shutdown is a clean exit: this returns normally (``corral serve`` exits 0),
    where a bare ``uvicorn.run`` re-raises the signal after shutting down (exit status -15).
    A port that cannot be bound raises :class:`corral.serving.BindError` (an ``OSError``).
    This is :func:`corral.serving.serve_forever` with the manager's shutdown as its
    ``on_shutdown``.
    """
    from corral.serving import serve_forever

    manager: EpisodeManager = app.state.episodes
    serve_forever(
        app,
        host=host,
        port=port,
        limits=limits,
        log_level=log_level,
        access_log=access_log,
        on_shutdown=manager.shutdown,
        timeout_graceful_shutdown=timeout_graceful_shutdown,
    )
