"""Run an env server app with uvicorn until SIGINT / SIGTERM (:func:`run_server`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from corral.envs.episodes import EpisodeManager

# Keepalive pings (uvicorn) and the bound on uvicorn's graceful shutdown, used by run_server.
WS_PING_INTERVAL = 20.0
WS_PING_TIMEOUT = 20.0
GRACEFUL_SHUTDOWN_S = 10


def run_server(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 8200,
    log_level: str = "info",
    access_log: bool = False,
    timeout_graceful_shutdown: int = GRACEFUL_SHUTDOWN_S,
    ws_ping_interval: float = WS_PING_INTERVAL,
    ws_ping_timeout: float = WS_PING_TIMEOUT,
) -> None:
    """Run an app from :func:`build_app` with uvicorn until SIGINT / SIGTERM (blocks).

    On the signal, before uvicorn's own graceful shutdown, the app's manager shuts down: new
    episodes are refused, every socket is closed with 1001 and a reason, every episode is torn
    down. uvicorn then waits at most ``timeout_graceful_shutdown`` s for requests in flight
    (e.g. a tool call in a worker thread) before cancelling them. The server pings every
    socket each ``ws_ping_interval`` s and drops one that does not answer within
    ``ws_ping_timeout`` s.

    A SIGTERM shutdown is a clean exit: this returns normally (``corral serve`` exits 0),
    where a bare ``uvicorn.run`` re-raises the signal after shutting down (exit status -15).
    """
    import signal
    import threading

    import uvicorn

    from corral.serving import KEEP_ALIVE_S

    manager: EpisodeManager = app.state.episodes

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            await manager.shutdown()
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=timeout_graceful_shutdown,
        ws_ping_interval=ws_ping_interval,
        ws_ping_timeout=ws_ping_timeout,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    if threading.current_thread() is not threading.main_thread():
        _Server(config).run()
        return
    # uvicorn restores this handler after its shutdown and re-raises the SIGTERM it caught:
    # a no-op here makes the graceful shutdown the end of it.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        _Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
