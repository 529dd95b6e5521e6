"""Serve a bundle's episodes over WebSocket, its tasks over HTTP (``build_app``).

The FastAPI layer is thin: it authenticates, parses messages (:mod:`corral.envs.protocol`) and
forwards them to an :class:`EpisodeManager` (capacity, idle reaping, timeouts) and
:class:`Episode` (one env's life: reset, tool calls, turns, grading), which are plain classes.

The server speaks plain HTTP and WebSocket: the bearer token crosses the wire in clear text.
Outside loopback, put a TLS-terminating proxy in front of it (e.g. Caddy ``reverse_proxy``
or nginx ``proxy_pass`` with ``proxy_set_header Upgrade $http_upgrade``) and bind the server
to 127.0.0.1.

Where env code runs (:mod:`corral.envs.hosting`): with ``sandbox=None`` a bundle whose
``[sandbox] needs = "none"`` runs in the server's process, in worker threads, so a slow tool
never blocks the event loop; a tool call past ``tool_timeout`` is answered with a
``TOOL_TIMEOUT`` error and ends its episode, but the thread cannot be killed and runs on until
the env code returns. With a sandbox backend (``sandbox="bwrap"``, ``"docker"``, ...) every
episode's env runs in a sandbox of its own; a call past its deadline kills the sandbox, and an
episode's sandbox is removed as soon as the episode is graded or closed. The verifier always
runs in the server's process.

Shutdown (SIGTERM): :func:`run_server` runs the app with uvicorn and, before uvicorn's own
graceful shutdown, calls :meth:`EpisodeManager.shutdown`: new resets are refused (resets waiting
for capacity too), every live socket is closed with 1001 "going away" and a reason, and every
episode is torn down; uvicorn then stops within ``timeout_graceful_shutdown``. Under a plain
``uvicorn.run`` the lifespan's shutdown does the same, but only after uvicorn has closed the
sockets itself (code 1012, no reason).

Keepalive: the server pings every socket (uvicorn's ``ws_ping_interval`` / ``ws_ping_timeout``,
20 s / 20 s, passed explicitly by :func:`run_server`) and drops a peer that stops answering,
which closes its episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response
from fastapi.websockets import WebSocketState
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from corral.envs.bundle import Bundle, TaskNotFound, load_bundle
from corral.envs.episodes import (
    DEFAULT_MAX_CONCURRENT_ENVS,
    GOING_AWAY,
    SHUTDOWN_REASON,
    Episode,
    EpisodeManager,
    Metrics,
    RewardFn,
    ServerError,
    task_tools,
)
from corral.envs.hosting import (
    EnvHost,
    InProcessHost,
    SandboxHost,
)
from corral.envs.protocol import (
    ErrorMessage,
)
from corral.envs.running import run_server
from corral.envs.session import Session
from corral.sandboxes.base import NetworkPolicy, SandboxProvider, SandboxSpec
from corral.sandboxes.providers import make_provider

# WebSocket close code for a refused token (RFC 6455: policy violation).
POLICY_VIOLATION = 1008


def _bearer_ok(header: str | None, token: str) -> bool:
    scheme, _, value = (header or "").partition(" ")
    # compare_digest on bytes: constant time in the token's content, whatever the length.
    return scheme.lower() == "bearer" and hmac.compare_digest(value.encode(), token.encode())


def env_host(
    bundle: Bundle,
    sandbox: str | SandboxProvider | None,
    *,
    image: str | None = None,
    warm: int = 0,
) -> EnvHost:
    """Where ``bundle``'s envs run (see :func:`build_app`'s ``sandbox``)."""
    needs = bundle.manifest.sandbox
    if sandbox is None:
        if needs.needs != "none":
            raise ValueError(
                f"bundle {bundle.name!r} needs a sandbox ([sandbox] needs = {needs.needs!r}): "
                "serve it with --sandbox bwrap or docker (kubernetes and e2b where configured; "
                "local for development only, with no isolation)"
            )
        return InProcessHost(bundle)
    if isinstance(sandbox, str):
        sandbox = make_provider(sandbox, f"serve-{bundle.name}", image=image or needs.image)
    spec = SandboxSpec(
        workdir="/work",
        memory_mb=needs.memory_mb,
        cpus=needs.cpus,
        pids=needs.pids,
        disk_mb=needs.disk_mb,
        network=NetworkPolicy(mode=needs.network),
        labels={"corral.bundle": bundle.name},
    )
    return SandboxHost(bundle, sandbox, spec, warm=warm)


def build_app(
    bundle: Bundle | Path | str,
    *,
    max_concurrent_envs: int = DEFAULT_MAX_CONCURRENT_ENVS,
    token: str | None = None,
    reset_timeout: float = 600.0,
    idle_timeout: float = 600.0,
    tool_timeout: float = 60.0,
    reward: RewardFn | None = None,
    sandbox: str | SandboxProvider | None = None,
    sandbox_image: str | None = None,
    warm_sandboxes: int = 0,
) -> FastAPI:
    """A FastAPI app serving ``bundle`` (a loaded Bundle or its folder).

    Routes: ``GET /health`` (never needs the token), ``GET /splits``, ``GET /tasks/{split}``,
    ``GET /tasks/{split}/{index}``, ``GET /metrics`` and the WebSocket ``/ws`` (protocol in
    :mod:`corral.envs.protocol`). With a ``token``, every route but ``/health`` requires
    ``Authorization: Bearer <token>``: HTTP answers 401, the socket is closed with 1008
    before any env is created. The manager is at ``app.state.episodes``.

    ``sandbox``: where each episode's env runs (:mod:`corral.envs.hosting`): ``None`` runs a
    bundle that needs no sandbox in this process and refuses one that does (``ValueError``);
    a backend name (:data:`~corral.sandboxes.providers.BACKENDS`) or a provider runs every
    episode in a sandbox of its own, with the bundle's ``[sandbox]`` limits, ``sandbox_image``
    as the image or template, and ``warm_sandboxes`` started ahead. The server sweeps the
    backend's leftovers of dead servers when it starts.
    """
    loaded = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    host = env_host(loaded, sandbox, image=sandbox_image, warm=warm_sandboxes)
    metrics = Metrics()
    manager = EpisodeManager(
        loaded,
        max_concurrent_envs=max_concurrent_envs,
        reset_timeout=reset_timeout,
        idle_timeout=idle_timeout,
        tool_timeout=tool_timeout,
        metrics=metrics,
        reward=reward,
        host=host,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await host.open()
        reaper = asyncio.create_task(manager.reaper())
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await manager.shutdown()
            await host.aclose()

    def require_token(request: Request) -> None:
        if token is not None and not _bearer_ok(request.headers.get("authorization"), token):
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    app = FastAPI(title=f"corral env server: {loaded.name}", lifespan=lifespan)
    app.state.episodes = manager
    authed = [Depends(require_token)]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "healthy",
            "bundle": loaded.name,
            "version": loaded.manifest.version,
            "envs": host.description,
        }

    @app.get("/splits", dependencies=authed)
    async def splits() -> dict[str, Any]:
        return {
            "splits": [{"name": s, "tasks": len(loaded.tasks(s))} for s in loaded.splits],
            "group_by": loaded.manifest.eval.group_by,
        }

    @app.get("/tasks/{split}", dependencies=authed)
    async def tasks(split: str) -> dict[str, Any]:
        try:
            found = loaded.tasks(split)
        except TaskNotFound as exc:
            raise HTTPException(404, str(exc)) from None
        return {"split": split, "tasks": [{"index": t.index, "id": t.id} for t in found]}

    @app.get("/tasks/{split}/{index}", dependencies=authed)
    async def task(split: str, index: int) -> dict[str, Any]:
        try:
            found = loaded.task(split, index)
        except TaskNotFound as exc:
            raise HTTPException(404, str(exc)) from None
        return {
            "id": found.id,
            "split": found.split,
            "index": found.index,
            "system_prompt": loaded.manifest.system_prompt,
            "prompt": found.prompt,
            "max_turns": loaded.manifest.max_turns,
            "tools": task_tools(loaded, found),
            "data": found.data,
        }

    @app.get("/metrics", dependencies=authed)
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        if token is not None and not _bearer_ok(websocket.headers.get("authorization"), token):
            # Accept, then close with a reason: a close before accept reaches the client as a
            # bare HTTP 403 with no explanation.
            await websocket.accept()
            await websocket.close(POLICY_VIOLATION, "missing or wrong bearer token")
            return
        await websocket.accept()
        if manager.closing:
            await websocket.close(GOING_AWAY, SHUTDOWN_REASON)
            return
        session = Session(manager)

        async def hang_up_socket(code: int, reason: str) -> None:
            # Checked and sent with no await between: never a send after the close.
            if websocket.application_state == WebSocketState.CONNECTED:
                await websocket.close(code, reason)

        key = id(websocket)
        manager.add_socket(key, hang_up_socket)
        try:
            while True:
                frame = await websocket.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                text = frame.get("text")
                if text is None:
                    text = (frame.get("bytes") or b"").decode("utf-8", "replace")
                reply, hang_up = await session.handle(text)
                if websocket.application_state != WebSocketState.CONNECTED:
                    break  # hung up by shutdown while the message was handled
                if reply is not None:
                    await websocket.send_text(reply)
                if hang_up:
                    await websocket.close()
                    break
        except WebSocketDisconnect:
            pass
        finally:
            manager.remove_socket(key)
            await session.close()

    return app


__all__ = [
    "Episode",
    "EpisodeManager",
    "ErrorMessage",
    "Metrics",
    "ServerError",
    "build_app",
    "run_server",
]
