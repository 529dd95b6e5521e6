"""Serve a bundle's episodes in OpenEnv's wire format (``build_app``): over WebSocket, HTTP
and MCP JSON-RPC, with its tasks over HTTP.

This module is the app's assembly: it picks where envs run, makes the
:class:`~corral.envs.episodes.EpisodeManager` (capacity, idle reaping, timeouts; its
:class:`~corral.envs.episodes.Episode` objects are one env's life: reset, tool calls, turns,
grading), authenticates, and mounts the routes of the modules whose job they are: the
WebSockets (:mod:`corral.envs.websocket`, one :class:`~corral.envs.websocket.SocketConversation`
per socket), HTTP episodes (:mod:`corral.envs.http_episodes`), MCP JSON-RPC over HTTP
(:mod:`corral.envs.mcp`) and the bundle's tasks, schema and metadata
(:mod:`corral.envs.catalog`). Refusals are raised as errors and mapped to their HTTP answers
once, by the app's exception handlers.

The server speaks plain HTTP and WebSocket: the bearer token crosses the wire in clear text.
Outside loopback, put a TLS-terminating proxy in front of it (e.g. Caddy ``reverse_proxy``
or nginx ``proxy_pass`` with ``proxy_set_header Upgrade $http_upgrade``) and bind the server
to 127.0.0.1.

Where env code runs (:mod:`corral.envs.hosting`): with ``sandbox=None`` a bundle whose
``[sandbox] needs = "none"`` runs in the server's process, in worker threads, so a slow tool
never blocks the event loop; a tool call past ``tool_timeout`` is answered with a
``timeout`` tool error and ends its episode, but the thread cannot be killed and runs on until
the env code returns. With a sandbox backend (``sandbox="bwrap"``, ``"docker"``, ...) every
episode's env runs in a sandbox of its own; a call past its deadline kills the sandbox, and an
episode's sandbox is removed as soon as the episode is graded or closed. The verifier always
runs in the server's process.

Black-box agents (the ``agent`` frame on ``/ws``,
:meth:`~corral.envs.episodes.EpisodeManager.run_agent`): a launch runs in the episode's sandbox
(:mod:`corral.envs.agent_bridge`) while the socket goes on being served; the reply comes when
the agent has exited and the episode is graded. ``build_app``'s ``agent_*`` options are the
server's policy and the operator's agent CLIs.

Shutdown (SIGTERM): :func:`~corral.envs.running.run_server` runs the app with uvicorn and,
before uvicorn's own graceful shutdown, calls
:meth:`~corral.envs.episodes.EpisodeManager.shutdown`: new resets are refused (resets waiting
for capacity too), every live socket is closed with 1001 "going away" and a reason, and every
episode is torn down; uvicorn then stops within ``timeout_graceful_shutdown``. Under a plain
``uvicorn.run`` the lifespan's shutdown does the same, but only after uvicorn has closed the
sockets itself (code 1012, no reason).

Transport (:mod:`corral.transport`, applied by :func:`~corral.envs.running.run_server`): the
server pings every socket every 20 s and drops a peer that does not answer within 20 s, which
closes its episode; request heads and bodies have deadlines and idle or slow connections are
capped, so they cannot use up the process's file descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import HTTPConnection

from corral.envs.agent_bridge import AgentPolicy
from corral.envs.bundle import Bundle, TaskNotFound, load_bundle
from corral.envs.catalog import catalog_routes
from corral.envs.episodes import (
    DEFAULT_MAX_CONCURRENT_ENVS,
    EpisodeManager,
    Metrics,
    RewardFn,
    ServerError,
)
from corral.envs.hosting import env_host
from corral.envs.http_episodes import HttpEpisodes, error_response, http_episode_routes
from corral.envs.mcp import McpHandler, mcp_http_routes
from corral.envs.settings import (
    FIRST_RESET_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    RESET_TIMEOUT_S,
    TOOL_TIMEOUT_S,
)
from corral.envs.websocket import socket_routes
from corral.sandboxes.base import SandboxProvider
from corral.transport import TransportLimits

# The cap on a black-box agent's budget: the bridge's policy default, defined there.
DEFAULT_AGENT_MAX_TIMEOUT_S = AgentPolicy().max_timeout_s
# The largest HTTP request body read (``POST /reset``, ``/step``, ``/mcp``): the same bound as
# a WebSocket message, since the same messages travel either way.
DEFAULT_MAX_BODY_BYTES = TransportLimits.ws_max_size


def _bearer_ok(header: str | None, token: str) -> bool:
    scheme, _, value = (header or "").partition(" ")
    # compare_digest on bytes: constant time in the token's content, whatever the length.
    return scheme.lower() == "bearer" and hmac.compare_digest(value.encode(), token.encode())


def build_app(
    bundle: Bundle | Path | str,
    *,
    max_concurrent_envs: int = DEFAULT_MAX_CONCURRENT_ENVS,
    token: str | None = None,
    reset_timeout: float = RESET_TIMEOUT_S,
    idle_timeout: float = IDLE_TIMEOUT_S,
    tool_timeout: float = TOOL_TIMEOUT_S,
    first_reset_timeout: float = FIRST_RESET_TIMEOUT_S,
    reward: RewardFn | None = None,
    sandbox: str | SandboxProvider | None = None,
    sandbox_image: str | None = None,
    warm_sandboxes: int = 0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    agent_clis: Path | None = None,
    agent_gateways: Sequence[str] = (),
    agent_max_timeout_s: float = DEFAULT_AGENT_MAX_TIMEOUT_S,
) -> FastAPI:
    """A FastAPI app serving ``bundle`` (a loaded Bundle or its folder).

    Routes (wire format in :mod:`corral.envs.protocol`): ``GET /health`` (never needs the
    token), the task API (``GET /splits``, ``/tasks/{split}``, ``/tasks/{split}/{index}``),
    ``GET /metrics``, OpenEnv's ``GET /schema`` and ``GET /metadata``, the WebSocket ``/ws``,
    HTTP episodes (``POST /reset``, ``POST /step``, ``GET /state?episode_id=``), and MCP
    JSON-RPC on ``POST /mcp`` and the WebSocket ``/mcp`` (:mod:`corral.envs.mcp`). With a
    ``token``, every route but ``/health`` requires ``Authorization: Bearer <token>``: HTTP
    answers 401, a socket is closed with 1008 before any env is created. With a token,
    ``GET /openapi.json`` needs it too and the browser pages ``/docs`` and ``/redoc`` are not
    served (a browser cannot send the header); with none, all three are FastAPI's. The manager
    is at ``app.state.episodes``; the app's version (OpenAPI ``info.version``) is the bundle's.

    A request body over ``max_body_bytes`` is refused with 413 before it is read whole; an
    HTTP reset whose client hangs up before its episode exists is cancelled (its slot freed),
    and one whose client is gone once it exists is closed at once.

    A ``/ws`` socket is closed (1008, with a reason) when no reset starts an episode within
    ``first_reset_timeout`` s of opening (whatever else it sends), or once it has been
    ``idle_timeout`` s without an episode since its last one ended (graded, closed, reaped:
    the reaper closes an episode idle for ``idle_timeout``); a ``/mcp`` socket likewise, from
    its opening or its last episode.

    ``sandbox``: where each episode's env runs (:mod:`corral.envs.hosting`): ``None`` runs a
    bundle that needs no sandbox in this process and refuses one that does (``ValueError``);
    a backend name (:data:`~corral.sandboxes.providers.BACKENDS`) or a provider runs every
    episode in a sandbox of its own, with the bundle's ``[sandbox]`` limits, ``sandbox_image``
    as the image or template, and ``warm_sandboxes`` started ahead. The server sweeps the
    backend's leftovers of dead servers when it starts.

    Black-box agents (the ``agent`` frame on ``/ws``; bundles with an ``[agent]`` section,
    served in a sandbox): ``agent_gateways`` are the gateway origins (``scheme://host:port``)
    agents' traffic is bridged to (empty: any loopback origin), ``agent_max_timeout_s`` caps a
    launch's budget, ``agent_clis`` is the operator's npm install of Claude Code and Codex,
    handed read-only to every sandbox of a backend that mounts host folders
    (:class:`~corral.envs.hosting.SandboxHost`; ``ValueError`` when it is not a folder).
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be at least 1, not {max_body_bytes}")
    loaded = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    if agent_max_timeout_s <= 0:
        raise ValueError(f"agent_max_timeout_s must be positive, not {agent_max_timeout_s:g}")
    policy = AgentPolicy(gateways=tuple(agent_gateways), max_timeout_s=agent_max_timeout_s)
    host = env_host(
        loaded,
        sandbox,
        image=sandbox_image,
        warm=warm_sandboxes,
        agent_clis=agent_clis,
        agent_policy=policy,
    )
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
    http_episodes = HttpEpisodes(manager)

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

    def authorized(connection: HTTPConnection) -> bool:
        return token is None or _bearer_ok(connection.headers.get("authorization"), token)

    def require_token(request: Request) -> None:
        if not authorized(request):
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    # With a token the schema is served below, behind it; the HTML pages are not served.
    documented = token is None
    app = FastAPI(
        title=f"corral env server: {loaded.name}",
        version=loaded.manifest.version,
        lifespan=lifespan,
        openapi_url="/openapi.json" if documented else None,
        docs_url="/docs" if documented else None,
        redoc_url="/redoc" if documented else None,
    )
    app.state.episodes = manager
    authed = [Depends(require_token)]

    # Errors mapped once, here: a refusal (ServerError) as its error frame's data under
    # "detail" with its status; an unknown split or task as 404, as FastAPI's HTTPException.
    @app.exception_handler(ServerError)
    async def refused(_: Request, exc: ServerError) -> Response:
        return error_response(exc)

    @app.exception_handler(TaskNotFound)
    async def no_task(_: Request, exc: TaskNotFound) -> Response:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    if not documented:

        @app.get("/openapi.json", dependencies=authed, include_in_schema=False)
        async def openapi_behind_token() -> dict[str, Any]:
            return app.openapi()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "healthy",
            "bundle": loaded.name,
            "version": loaded.manifest.version,
            "envs": host.description,
        }

    app.include_router(catalog_routes(loaded), dependencies=authed)

    @app.get("/metrics", dependencies=authed)
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(
        http_episode_routes(http_episodes, max_body_bytes=max_body_bytes), dependencies=authed
    )
    app.include_router(
        mcp_http_routes(McpHandler(manager), http_episodes, max_body_bytes=max_body_bytes),
        dependencies=authed,
    )
    app.include_router(
        socket_routes(
            manager,
            authorized=authorized,
            first_reset_timeout=first_reset_timeout,
            idle_timeout=idle_timeout,
        )
    )
    return app
