"""``EnvClient``: an async client for the env server's WebSocket protocol.

One client is one socket and at most one episode at a time; calls are sequential (an
``asyncio.Lock`` serialises them). Every request carries a fresh ``request_id``; a reply with
another id (the late answer to a request that timed out) is dropped, so a timeout never makes
later replies answer the wrong call.

Dropped sockets (the server restarted or shut down, the connection was reset): the next call
opens a fresh socket instead of failing forever, but an episode never silently moves to it
(the server closes an episode with its socket). A call that needs the lost episode (a tool
call, ``list_tools``, ``state``) raises :class:`EpisodeLostError` until the next ``reset``,
which plays on a fresh socket. A ``reset`` whose socket turns out to be dead is retried once on
a fresh one (safe: the dead socket's episode is gone anyway).

Keepalive: the client keeps the websockets library's defaults (a ping every 20 s, the socket is
dropped when no pong comes within 20 s); the server pings too (see :mod:`corral.envs.server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from types import TracebackType
from typing import Any, cast

import websockets
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection
from websockets.protocol import State

from corral.envs.agent_bridge import MAX_TRANSCRIPT_BYTES
from corral.envs.protocol import (
    SERVER_MESSAGE,
    AgentLaunch,
    AgentReply,
    AgentResult,
    CallToolObservation,
    EpisodeState,
    ErrorData,
    ErrorMessage,
    ListToolsObservation,
    McpReply,
    McpTool,
    ObservationMessage,
    ObsT,
    ResetObservation,
    ServerMessageT,
    StateMessage,
    StepResult,
)
from corral.envs.settings import RESET_TIMEOUT_S, TOOL_TIMEOUT_S


class EnvClientError(Exception):
    """The client could not talk to the server: unreachable, refused token, dropped socket,
    a timeout or a reply that breaks the protocol."""


class EpisodeLostError(EnvClientError):
    """The socket dropped while an episode was in progress: the episode is gone; ``reset``."""


class EnvServerError(EnvClientError):
    """The server answered ``error``: ``code`` (OpenEnv's ``WSErrorCode`` value), ``reason``
    (corral's finer case, or None) and ``data`` (all of the error's fields, e.g.
    ``active_sessions`` and ``max_sessions`` for ``CAPACITY_REACHED``)."""

    def __init__(self, data: ErrorData) -> None:
        why = f" ({data.reason.value})" if data.reason is not None else ""
        super().__init__(f"{data.code.value}{why}: {data.message}")
        self.code = data.code.value
        self.reason = data.reason.value if data.reason is not None else None
        self.data = data.model_dump(mode="json", exclude_none=True)


# Errors after which the socket has no episode in progress.
_EPISODE_OVER_REASONS = frozenset({"episode_done", "no_episode", "state_too_large", "agent_failed"})
# What an agent frame's reply may take beyond the agent's budget and kill grace, besides the
# ending of the episode (see EnvClient.run_agent): the launcher's start and the files it writes.
AGENT_START_S = 30.0
# The largest frame the client takes: an agent reply carries a transcript of up to
# MAX_TRANSCRIPT_BYTES, which JSON escaping may grow up to six times (control bytes become
# \u00XX); websockets' default 1 MiB would drop the socket, and the episode with it.
MAX_FRAME_BYTES = 6 * MAX_TRANSCRIPT_BYTES + 2**20


def ws_url(url: str) -> str:
    """The socket URL for a server URL: ``http(s)://host:port`` -> ``ws(s)://host:port/ws``."""
    if url.startswith("http://"):
        url = "ws://" + url.removeprefix("http://")
    elif url.startswith("https://"):
        url = "wss://" + url.removeprefix("https://")
    return url if url.rstrip("/").endswith("/ws") else url.rstrip("/") + "/ws"


class EnvClient:
    """Play episodes on an env server at ``url`` (http(s):// or ws(s)://).

    ``timeout`` bounds each reply (a reset may wait for capacity: pass ``reset_timeout`` above
    the server's). Connects on first use; ``close()`` (or ``async with``) ends the episode and
    the socket. Raises :class:`EnvServerError` for ``error`` replies and
    :class:`EnvClientError` for transport problems.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = TOOL_TIMEOUT_S,
        reset_timeout: float = RESET_TIMEOUT_S + TOOL_TIMEOUT_S,
        open_timeout: float = 10.0,
    ) -> None:
        self.url = ws_url(url)
        self._token = token
        self.timeout = timeout
        self.reset_timeout = reset_timeout
        self.open_timeout = open_timeout
        self._ws: ClientConnection | None = None
        # An episode was started and has not ended: a dropped socket loses it.
        self._in_episode = False
        # Why the socket dropped with an episode in progress (None: nothing lost).
        self._lost: str | None = None
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> EnvClient:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the socket (done by the first call when not called; a dead one is replaced)."""
        if self._ws is not None and self._ws.state is State.OPEN:
            return
        if self._ws is not None:
            self._dropped(self._ws)
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            self._ws = await websockets.connect(
                self.url,
                additional_headers=headers,
                open_timeout=self.open_timeout,
                max_size=MAX_FRAME_BYTES,
            )
        except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
            raise EnvClientError(f"cannot connect to {self.url}: {exc}") from exc

    async def reset(
        self,
        split: str | None = None,
        index: int | None = None,
        *,
        task_id: str | None = None,
        seed: int | None = None,
        episode_id: str | None = None,
    ) -> StepResult[ResetObservation]:
        """Start an episode on ``split``/``index`` or ``task_id`` (or, naming neither, the
        server's default split, by ``seed`` or in turn): the prompt, system prompt and tools."""
        data: dict[str, Any] = {"task_id": task_id} if task_id else {}
        if split is not None or index is not None:
            data.update(split=split, index=index)
        if seed is not None:
            data["seed"] = seed
        if episode_id is not None:
            data["episode_id"] = episode_id
        reply = await self._request({"type": "reset", "data": data}, self.reset_timeout)
        return self._observation(reply, ResetObservation)

    async def call_tool(self, name: str, arguments: Any) -> StepResult[CallToolObservation]:
        """Call a tool (``arguments``: an object, or JSON text of one); ``done`` and
        ``reward`` are set on the call that ends the episode. A tool failure is an
        observation (``observation.error``), never an exception."""
        action = {"type": "call_tool", "tool_name": name, "arguments": arguments}
        reply = await self._request({"type": "step", "data": action}, self.timeout)
        return self._observation(reply, CallToolObservation)

    async def list_tools(self) -> list[McpTool]:
        """The tools in MCP's shape, ``end_turn`` last (the episode's; before any reset, the
        bundle's)."""
        reply = await self._request({"type": "step", "data": {"type": "list_tools"}}, self.timeout)
        return self._observation(reply, ListToolsObservation).observation.tools

    async def state(self) -> EpisodeState:
        """The episode's state: ids, counters, status and the env's own state under ``env``."""
        reply = await self._request({"type": "state"}, self.timeout)
        if not isinstance(reply, StateMessage):
            raise EnvClientError(f"expected a state reply, got {reply.type!r}")
        return reply.data

    async def run_agent(
        self, launch: AgentLaunch, *, finish_timeout: float | None = None
    ) -> AgentResult:
        """Run a black-box agent on the episode (reset first), in its sandbox, in the task's
        working folder; the server then ends the episode and grades it, and the result says
        how the agent ended (``run``) and the episode's ``status``, ``reward``, ``scores``
        or ``grade_error``. The episode is over afterwards.

        The reply is awaited for ``launch.timeout_s + launch.kill_grace_s`` (the agent's
        budget) plus :data:`AGENT_START_S` plus ``finish_timeout``: what the server may take
        to end and grade the episode (its finish tool, then up to ``max_turns`` end_turn
        calls, each within its tool timeout); default ``3 * timeout + 10`` s, one ending step
        with a server tool timeout equal to this client's ``timeout``. Refusals raise
        :class:`EnvServerError`: ``no_agent_support`` (the bundle has no ``[agent]``, or the
        server runs no sandbox), ``agent_running``, ``agent_refused`` (VALIDATION_ERROR: the
        launch breaks the server's policy; the episode goes on), ``agent_failed`` (its
        sandbox failed: the episode is over)."""
        finish = 3 * self.timeout + 10.0 if finish_timeout is None else finish_timeout
        limit_s = launch.timeout_s + launch.kill_grace_s + AGENT_START_S + finish
        message = {"type": "agent", "data": launch.model_dump(mode="json")}
        reply = await self._request(message, limit_s)
        if not isinstance(reply, AgentReply):
            raise EnvClientError(f"expected an agent reply, got {reply.type!r}")
        return reply.data

    async def close(self) -> None:
        """Close the episode and the socket (idempotent; never raises for a dead socket)."""
        ws, self._ws = self._ws, None
        self._in_episode, self._lost = False, None
        if ws is None:
            return
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.send(json.dumps({"type": "close"}))
        await ws.close()

    @staticmethod
    def _observation(reply: ServerMessageT, kind: type[ObsT]) -> StepResult[ObsT]:
        if not isinstance(reply, ObservationMessage):
            raise EnvClientError(f"expected an observation reply, got {reply.type!r}")
        obs = reply.data.observation
        if not isinstance(obs, kind):
            raise EnvClientError(f"expected a {kind.__name__}, got {type(obs).__name__}")
        result = StepResult[Any](observation=obs, reward=reply.data.reward, done=reply.data.done)
        return cast("StepResult[ObsT]", result)

    async def _request(self, message: dict[str, Any], limit_s: float) -> ServerMessageT:
        is_reset = message["type"] == "reset"
        async with self._lock:
            if is_reset:  # a reset replaces the episode: nothing left to lose
                self._lost, self._in_episode = None, False
            elif self._ws is not None and self._ws.state is not State.OPEN:
                self._dropped(self._ws)
            if self._lost is not None and not is_reset:
                raise EpisodeLostError(self._lost)
            try:
                reply = await self._exchange(message, limit_s)
            except websockets.ConnectionClosed as exc:
                if not is_reset:
                    raise self._closed_error(exc) from exc
                # A dead socket under a reset: once more on a fresh socket.
                try:
                    reply = await self._exchange(message, limit_s)
                except websockets.ConnectionClosed as again:
                    raise self._closed_error(again) from again
        if isinstance(reply, ErrorMessage):
            reason = reply.data.reason
            if reply.data.code.value == "SESSION_ERROR" or reason in _EPISODE_OVER_REASONS:
                self._in_episode = False
            raise EnvServerError(reply.data)
        if isinstance(reply, McpReply):
            raise EnvClientError("the server answered a JSON-RPC frame to a step")
        if isinstance(reply, ObservationMessage):
            self._in_episode = not reply.data.done
        if isinstance(reply, AgentReply):  # the server ended the episode after the agent
            self._in_episode = False
        return reply

    async def _exchange(self, message: dict[str, Any], limit_s: float) -> ServerMessageT:
        """Send ``message`` and return its reply (ConnectionClosed passes through)."""
        await self.connect()
        ws = self._ws
        assert ws is not None
        request_id = f"c{next(self._ids)}"
        try:
            await ws.send(json.dumps({**message, "request_id": request_id}))
            async with asyncio.timeout(limit_s):
                while True:
                    reply = self._parse(await ws.recv())
                    if reply.request_id == request_id:
                        return reply
                    # else: a late reply to an earlier request that timed out; skip it
        except TimeoutError:
            raise EnvClientError(f"no reply to {message['type']!r} within {limit_s:g} s") from None

    def _closed_error(self, exc: websockets.ConnectionClosed) -> EnvClientError:
        """Forget the dead socket; the error for the call that found it dead."""
        reason = f"code {exc.rcvd.code}: {exc.rcvd.reason}" if exc.rcvd else "no close frame"
        self._dropped(self._ws)
        if self._lost is not None:
            return EpisodeLostError(self._lost)
        return EnvClientError(f"the server closed the socket ({reason}); the next call reconnects")

    def _dropped(self, ws: ClientConnection | None) -> None:
        """The socket ``ws`` is dead: forget it, and the episode if one was in progress."""
        if ws is not None and ws is self._ws:
            self._ws = None
        if self._in_episode:
            self._in_episode = False
            code = ws.close_code if ws is not None else None
            why = f"code {code}: {ws.close_reason}" if ws is not None and code else "no close frame"
            self._lost = (
                f"the episode was lost: the connection to the server dropped ({why}); "
                "call reset to start a new episode on a fresh socket"
            )

    @staticmethod
    def _parse(frame: str | bytes) -> ServerMessageT:
        try:
            return SERVER_MESSAGE.validate_json(frame)
        except ValidationError as exc:
            raise EnvClientError(f"the server sent a malformed message: {exc}") from exc
