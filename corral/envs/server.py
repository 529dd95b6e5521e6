"""Serve a bundle's episodes in OpenEnv's wire format (``build_app``): over WebSocket, HTTP
and MCP JSON-RPC, with its tasks over HTTP.

The FastAPI layer is thin: it authenticates, parses messages (:mod:`corral.envs.protocol`) and
forwards them to :class:`~corral.envs.session.Session` (one socket),
:class:`~corral.envs.http_episodes.HttpEpisodes` (episodes by id) and
:class:`~corral.envs.mcp.McpHandler` (JSON-RPC), which drive an :class:`EpisodeManager`
(capacity, idle reaping, timeouts) and its :class:`Episode` objects (one env's life: reset,
tool calls, turns, grading): plain classes.

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

Black-box agents (the ``agent`` frame on ``/ws``, :meth:`EpisodeManager.run_agent`): a launch
runs in the episode's sandbox (:mod:`corral.envs.agent_bridge`) while the socket goes on being
served; the reply comes when the agent has exited and the episode is graded. ``build_app``'s
``agent_*`` options are the server's policy and the operator's agent CLIs.

Shutdown (SIGTERM): :func:`run_server` runs the app with uvicorn and, before uvicorn's own
graceful shutdown, calls :meth:`EpisodeManager.shutdown`: new resets are refused (resets waiting
for capacity too), every live socket is closed with 1001 "going away" and a reason, and every
episode is torn down; uvicorn then stops within ``timeout_graceful_shutdown``. Under a plain
``uvicorn.run`` the lifespan's shutdown does the same, but only after uvicorn has closed the
sockets itself (code 1012, no reason).

Transport (:mod:`corral.transport`, applied by :func:`run_server`): the server pings every
socket every 20 s and drops a peer that does not answer within 20 s, which closes its episode;
request heads and bodies have deadlines and idle or slow connections are capped, so they cannot
use up the process's file descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response
from fastapi.websockets import WebSocketState
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from corral.envs.agent_bridge import AgentPolicy
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
from corral.envs.http_episodes import HttpEpisodes, http_status
from corral.envs.mcp import HttpScope, McpHandler, RpcCode, rpc_error
from corral.envs.protocol import (
    MAX_FRAME_DEPTH,
    STEP_ACTION,
    EpisodeState,
    ErrorCode,
    ErrorData,
    ErrorMessage,
    ListToolsAction,
    Observation,
    Reason,
    ResetData,
    StepAction,
    depth,
    json_safe_errors,
)
from corral.envs.running import run_server
from corral.envs.session import Session
from corral.sandboxes.base import NetworkPolicy, SandboxProvider, SandboxSpec
from corral.sandboxes.providers import make_provider
from corral.transport import TransportLimits

# WebSocket close code for a refused token or a socket that plays nothing (RFC 6455: policy
# violation).
POLICY_VIOLATION = 1008
# How long an authenticated /ws socket may wait before its first reset.
DEFAULT_FIRST_RESET_TIMEOUT = 120.0
# The cap on a black-box agent's budget: the bridge's policy default, defined there.
DEFAULT_AGENT_MAX_TIMEOUT_S = AgentPolicy().max_timeout_s
# The largest HTTP request body read (``POST /reset``, ``/step``, ``/mcp``): the same bound as
# a WebSocket message, since the same messages travel either way.
DEFAULT_MAX_BODY_BYTES = TransportLimits.ws_max_size

_T = TypeVar("_T")


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
    agent_clis: Path | None = None,
    agent_policy: AgentPolicy | None = None,
) -> EnvHost:
    """Where ``bundle``'s envs run (see :func:`build_app`'s ``sandbox`` and agent options;
    in-process envs run no agents, so these are unused there)."""
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
    return SandboxHost(
        bundle, sandbox, spec, warm=warm, agent_clis=agent_clis, agent_policy=agent_policy
    )


def build_app(
    bundle: Bundle | Path | str,
    *,
    max_concurrent_envs: int = DEFAULT_MAX_CONCURRENT_ENVS,
    token: str | None = None,
    reset_timeout: float = 600.0,
    idle_timeout: float = 600.0,
    tool_timeout: float = 60.0,
    first_reset_timeout: float = DEFAULT_FIRST_RESET_TIMEOUT,
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
    rpc = McpHandler(manager)

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

    @app.get("/schema", dependencies=authed)
    async def schema() -> dict[str, Any]:
        return {
            "action": STEP_ACTION.json_schema(),
            "observation": TypeAdapter(Observation).json_schema(),
            "state": EpisodeState.model_json_schema(),
        }

    @app.get("/metadata", dependencies=authed)
    async def metadata() -> dict[str, Any]:
        readme = Path(loaded.root) / "README.md"
        return {
            "name": loaded.name,
            "description": loaded.manifest.description,
            "version": loaded.manifest.version,
            "readme_content": readme.read_text() if readme.is_file() else None,
            "author": None,
            "documentation_url": None,
        }

    @app.post("/reset", dependencies=authed)
    async def http_reset(request: Request) -> Response:
        try:
            body = await _json_body(request, max_body_bytes, allow_empty=True)
            try:
                data = ResetData.model_validate(body if body is not None else {})
            except ValidationError as exc:
                raise _validation(exc) from None
            opened = await _unless_client_leaves(request, http_episodes.open(data))
        except ServerError as exc:
            return _http_error(exc)
        if opened is None:  # the client hung up while its env started: nobody has the id
            return Response(status_code=499)
        episode, result = opened
        if await request.is_disconnected():
            await http_episodes.close(episode.id)
            return Response(status_code=499)
        return _json(result)

    @app.post("/step", dependencies=authed)
    async def http_step(request: Request) -> Response:
        try:
            body = await _json_body(request, max_body_bytes)
            try:
                step = HttpStep.model_validate(body)
            except ValidationError as exc:
                raise _validation(exc) from None
            episode = http_episodes.get(step.episode_id)
            if isinstance(step.action, ListToolsAction):
                manager.check_live(episode)
                return _json(episode.list_tools())
            return _json(await manager.step(episode, step.action))
        except ServerError as exc:
            return _http_error(exc)

    @app.get("/state", dependencies=authed)
    async def http_state(episode_id: str | None = None) -> Response:
        try:
            return _json(await manager.state(http_episodes.get(episode_id)))
        except ServerError as exc:
            return _http_error(exc)

    @app.post("/mcp", dependencies=authed, response_model=None)
    async def mcp_post(request: Request) -> Response | dict[str, Any]:
        try:
            text = await _read_body(request, max_body_bytes)
        except ServerError as exc:
            body = rpc_error(RpcCode.INVALID_REQUEST, str(exc))
            return Response(json.dumps(body), status_code=413, media_type="application/json")
        reply = await rpc.handle_text(text, HttpScope(http_episodes))
        if reply is None:  # a notification: accepted, and JSON-RPC answers nothing
            return Response(status_code=202)
        return reply

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        session = Session(manager)
        await _serve_socket(websocket, session, mcp=False)

    @app.websocket("/mcp")
    async def mcp_ws(websocket: WebSocket) -> None:
        session = Session(manager)
        await _serve_socket(websocket, session, mcp=True)

    async def _serve_socket(websocket: WebSocket, session: Session, *, mcp: bool) -> None:
        """One socket's life: ``/ws`` frames, or JSON-RPC ones on ``/mcp``. Deadlines (see
        :func:`build_app`) are fixed points in time, not waits per frame, so frames that start
        no episode do not keep the socket; a live episode's own idle deadline wakes the loop
        too, so a reap during the wait is seen."""
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

        async def hang_up_socket(code: int, reason: str) -> None:
            # Checked and sent with no await between: never a send after the close.
            if websocket.application_state == WebSocketState.CONNECTED:
                await websocket.close(code, reason)

        key = id(websocket)
        manager.add_socket(key, hang_up_socket)
        # time.monotonic: the clock of the episodes' last_active.
        first_reset_by = time.monotonic() + first_reset_timeout
        episodeless_since = time.monotonic()
        ended: Episode | None = None  # the last episode whose end this loop has seen
        ever_reset = False
        ended_by_reaper = False
        # One receive at a time, kept across deadline wake-ups: a receive is never cancelled
        # halfway through a message.
        receiving: asyncio.Future[Any] | None = None
        try:
            while True:
                episode = session.episode
                live = episode is not None and manager.is_open(episode)
                if episode is not None and not live and episode is not ended:
                    # (Even one that began and ended within a single frame.)
                    ended = episode
                    episodeless_since = time.monotonic()
                    ended_by_reaper = episode.closed_as == "reaped"
                ever_reset = ever_reset or episode is not None
                if live:
                    assert episode is not None
                    # Past this the reaper may close the episode: look again then.
                    deadline = episode.last_active + idle_timeout + _REAP_SLACK_S
                    if deadline <= time.monotonic():
                        # Looked already and it was not reapable (a step in flight): the
                        # reaper has it; look again only after another idle_timeout.
                        deadline = time.monotonic() + idle_timeout
                elif ever_reset or mcp:
                    deadline = episodeless_since + idle_timeout
                else:
                    deadline = first_reset_by
                if receiving is None:
                    receiving = asyncio.ensure_future(websocket.receive())
                # A running agent frame is awaited beside the next frame: its reply may come
                # first, and the socket is served meanwhile (corral.envs.session).
                agent = session.agent
                waits: set[asyncio.Future[Any]] = (
                    {receiving} if agent is None else {receiving, agent}
                )
                done, _ = await asyncio.wait(
                    waits, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED
                )
                if agent is not None and agent in done:
                    if websocket.application_state != WebSocketState.CONNECTED:
                        break
                    await websocket.send_text(session.agent_reply())
                    if receiving not in done:
                        continue
                if not done:
                    if live:
                        await manager.reap_idle()  # the reaper's own test, without its lag
                        continue
                    if not (ever_reset or mcp):
                        why = f"no reset within {first_reset_timeout:g} s of connecting"
                    elif ended_by_reaper:
                        why = (
                            f"its episode was closed after {idle_timeout:g} s idle and no "
                            f"episode followed within {idle_timeout:g} s (idle_timeout)"
                        )
                    else:
                        why = f"no episode for {idle_timeout:g} s (idle_timeout)"
                    await hang_up_socket(POLICY_VIOLATION, why)
                    break
                frame = receiving.result()
                receiving = None
                if frame["type"] == "websocket.disconnect":
                    break
                text = frame.get("text")
                if text is None:
                    text = (frame.get("bytes") or b"").decode("utf-8", "replace")
                if mcp:
                    reply: str | None = await session.handle_mcp(text)
                    hang_up = False
                else:
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
            if receiving is not None:
                receiving.cancel()
            manager.remove_socket(key)
            await session.close()

    return app


# The reaper closes an episode idle *more than* idle_timeout: a socket's look at its
# episode waits this much longer, so the look finds it reapable.
_REAP_SLACK_S = 0.01


class HttpStep(BaseModel):
    """``POST /step``'s body: OpenEnv's StepRequest (its ``timeout_s`` and ``request_id``
    accepted and ignored: the server's tool timeout applies) naming the HTTP episode."""

    model_config = ConfigDict(extra="forbid")

    action: StepAction
    episode_id: str | None = Field(default=None, max_length=255)
    timeout_s: float | None = None
    request_id: str | None = None


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, read chunk by chunk; ServerError ``body_too_large`` (413) as soon as
    it is known to pass ``limit`` bytes, so an over-cap body is never held whole."""
    refusal = ServerError(
        ErrorCode.VALIDATION_ERROR,
        f"the request body is over {limit} bytes (the server's max_body_bytes)",
        Reason.BODY_TOO_LARGE,
        errors=[],
    )
    declared = request.headers.get("content-length", "")
    # isascii: "²" is a digit to isdigit but not to int; past 18 digits int() may refuse it too.
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise refusal
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise refusal
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_body(request: Request, limit: int, *, allow_empty: bool = False) -> Any:
    """The request's JSON body (at most ``limit`` bytes); ServerError INVALID_JSON /
    VALIDATION_ERROR otherwise."""
    text = await _read_body(request, limit)
    if allow_empty and not text.strip():
        return None
    try:
        body = json.loads(text)
    except RecursionError:
        raise ServerError(ErrorCode.INVALID_JSON, "the body is not JSON: too deep") from None
    except ValueError as exc:
        # ValueError, not only JSONDecodeError: bad UTF-8, and an integer past Python's digit
        # limit (4300), raise other ValueErrors.
        raise ServerError(ErrorCode.INVALID_JSON, f"the body is not JSON: {exc}") from None
    if depth(body) > MAX_FRAME_DEPTH:
        raise ServerError(
            ErrorCode.VALIDATION_ERROR,
            f"the body nests over {MAX_FRAME_DEPTH} levels deep",
            Reason.TOO_DEEP,
            errors=[],
        )
    return body


async def _unless_client_leaves(request: Request, work: Awaitable[_T]) -> _T | None:
    """``work``'s result, or None when the client hangs up first: then ``work`` is cancelled
    (an episode being created gives its slot back). The body must have been read."""

    async def hung_up() -> None:
        """Returns once the client has hung up; never, if that cannot be told."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:
            await asyncio.get_running_loop().create_future()  # let the work finish

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left (or this request was cancelled)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return None
    return task.result()


def _validation(exc: ValidationError) -> ServerError:
    errors = json_safe_errors(exc.errors())
    message = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors)
    return ServerError(ErrorCode.VALIDATION_ERROR, message, errors=errors)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _http_error(exc: ServerError) -> Response:
    """A refusal over HTTP: FastAPI's ``{"detail": ...}`` holding the error frame's data."""
    data = ErrorData(message=str(exc), code=exc.code, reason=exc.reason, **exc.extra)
    body = {"detail": data.model_dump(mode="json", exclude_none=True)}
    return Response(json.dumps(body), status_code=http_status(exc), media_type="application/json")


__all__ = [
    "Episode",
    "EpisodeManager",
    "ErrorMessage",
    "Metrics",
    "ServerError",
    "build_app",
    "run_server",
]
