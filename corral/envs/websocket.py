"""One WebSocket's life on the env server: ``/ws`` and the ``/mcp`` socket
(:func:`socket_routes`).

:class:`SocketConversation` turns frames into replies: it parses each frame
(:mod:`corral.envs.protocol`), dispatches it to the socket's episode
(:mod:`corral.envs.episodes`) or to the JSON-RPC handler (:mod:`corral.envs.mcp`) and encodes
the reply; it never touches the socket itself. No bad frame ends the socket or its episode:
each gets an ``error`` reply with one of OpenEnv's codes. :func:`serve_socket` is the socket's
loop around it: frames in, replies out, and the deadlines that close a socket playing nothing.

An ``agent`` frame (a black-box agent on the socket's episode) runs for as long as the agent's
budget: :meth:`SocketConversation.handle` checks it, starts it as
:attr:`SocketConversation.agent` and answers nothing; the socket's loop awaits that task beside
its next frame and sends its reply (an ``agent`` frame, or the ``error``) when it is done.
Meanwhile the socket is served: ``state`` is answered, ``close`` stops the agent and closes the
episode, every other frame is refused (EXECUTION_ERROR ``agent_running``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.websockets import WebSocketState
from pydantic import ValidationError

from corral.envs.episodes import (
    GOING_AWAY,
    SHUTDOWN_REASON,
    Episode,
    EpisodeManager,
    ServerError,
    bundle_tools,
)
from corral.envs.mcp import McpHandler, RpcCode, RpcError
from corral.envs.protocol import (
    CLIENT_MESSAGE,
    CLIENT_TYPES,
    MAX_FRAME_DEPTH,
    NEW_SHAPE_HINT,
    AgentMessage,
    AgentReply,
    CallToolAction,
    ClientMessageT,
    CloseMessage,
    ErrorCode,
    ListToolsObservation,
    McpMessage,
    McpReply,
    Reason,
    RequestId,
    ResetData,
    ResetMessage,
    StateMessage,
    StateRequest,
    StepResult,
    depth,
    encode,
    encode_observation,
    error_message,
    json_safe_errors,
    quoted,
)

log = logging.getLogger(__name__)

# corral's step shapes before they were OpenEnv's: refused with a pointer to the new one.
_OLD_STEP_KEYS = frozenset({"call_tool", "list_tools"})
# WebSocket close code for a refused token or a socket that plays nothing (RFC 6455: policy
# violation).
POLICY_VIOLATION = 1008
# The reaper closes an episode idle *more than* idle_timeout: a socket's look at its
# episode waits this much longer, so the look finds it reapable.
_REAP_SLACK_S = 0.01


class SocketConversation:
    """One socket's conversation: at most one episode at a time; turns frames into replies.
    Closing the conversation (or the socket) closes its episode. Its JSON-RPC requests (``mcp``
    frames on ``/ws``, every frame on ``/mcp``) play the socket's episode
    (:class:`SocketScope`)."""

    def __init__(self, manager: EpisodeManager) -> None:
        self.manager = manager
        self.episode: Episode | None = None
        self.rpc = McpHandler(manager)
        # The running agent frame: its task gives the reply frame's text (module docstring).
        self.agent: asyncio.Task[str] | None = None

    @property
    def agent_running(self) -> bool:
        """An agent frame is in progress: running, or done with its reply not yet sent (so no
        frame handled in between can replace it)."""
        return self.agent is not None

    def agent_reply(self) -> str:
        """The finished agent frame's reply text (the socket's loop sends it); forgets it."""
        task, self.agent = self.agent, None
        assert task is not None and task.done()
        return task.result()

    # -- the socket's JSON-RPC session ------------------------------------------------------

    async def create(self, data: ResetData) -> str:
        """The socket's episode's id, after starting one (as ``data`` says) if it has none.
        With a live episode, ``data`` must agree with it (its task, its id): RpcError
        -32602 otherwise, rather than silently ignoring what the client asked for."""
        live = self.episode
        if live is not None and self.manager.is_open(live):
            if data.episode_id is not None and data.episode_id != live.id:
                raise RpcError(
                    RpcCode.INVALID_PARAMS,
                    f"this socket already plays episode {quoted(live.id)}, not "
                    f"{quoted(data.episode_id)}: a socket has one session",
                )
            if data.task_id is not None or data.split is not None or data.seed is not None:
                # Naming no task at all picks the next in turn: only a named task (or seed)
                # can disagree with the live one.
                task = self.manager.find_task(data)  # ServerError for a task that is not
                if task.id != live.task.id:
                    raise RpcError(
                        RpcCode.INVALID_PARAMS,
                        f"this socket already plays task {quoted(live.task.id)}, not "
                        f"{quoted(task.id)}: a socket plays one episode at a time",
                    )
            return live.id
        await self._reset(data)
        assert self.episode is not None
        return self.episode.id

    def find(self, session_id: str | None) -> Episode | None:
        """The socket's episode (None: none yet); ``session_id``, when given, must be its id."""
        episode = self.episode
        if session_id is not None and (episode is None or episode.id != session_id):
            raise RpcError(RpcCode.INVALID_PARAMS, f"Unknown session_id: {quoted(session_id)}")
        return episode

    async def close_session(self, session_id: str | None) -> None:
        """Refused, as OpenEnv's server refuses it: the socket owns its session."""
        raise RpcError(
            RpcCode.INVALID_REQUEST,
            "a socket's own session closes with the socket (or a reset replaces it)",
        )

    # -- frames -----------------------------------------------------------------------------

    async def handle_mcp(self, text: str) -> str | None:
        """The JSON-RPC response frame to one frame of the ``/mcp`` socket (None for a
        notification: no frame)."""
        response = await self.rpc.handle_text(text, SocketScope(self, start_on_call=True))
        return None if response is None else json.dumps(response)

    async def handle(self, text: str) -> tuple[str | None, bool]:
        """The reply frame to one client frame (None for none), and whether to hang up."""
        request_id: RequestId | None = None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            return encode(error_message(ErrorCode.INVALID_JSON, f"not JSON: {exc.msg}")), False
        except ValueError as exc:  # valid JSON past what Python parses: a 4301-digit integer
            reply = error_message(ErrorCode.INVALID_JSON, f"not JSON this server reads: {exc}")
            return encode(reply), False
        except RecursionError:
            reply = error_message(
                ErrorCode.INVALID_JSON, "not JSON this server reads: nested too deeply"
            )
            return encode(reply), False
        if not isinstance(raw, dict):
            reply = error_message(ErrorCode.INVALID_JSON, "a message must be a JSON object")
            return encode(reply), False
        rid = raw.get("request_id")
        if isinstance(rid, str | int) and not isinstance(rid, bool):
            request_id = rid  # echoed even when the rest is malformed
        if depth(raw) > MAX_FRAME_DEPTH:
            reply = error_message(
                ErrorCode.VALIDATION_ERROR,
                f"the message nests over {MAX_FRAME_DEPTH} levels deep",
                request_id,
                reason=Reason.TOO_DEEP,
                errors=[],
            )
            return encode(reply), False
        if raw.get("type") not in CLIENT_TYPES:
            message = f"unknown message type {raw.get('type')!r}; expected one of {CLIENT_TYPES}"
            return encode(error_message(ErrorCode.UNKNOWN_TYPE, message, request_id)), False
        data = raw.get("data")
        if raw["type"] == "step" and isinstance(data, dict) and _OLD_STEP_KEYS & data.keys():
            reply = error_message(
                ErrorCode.VALIDATION_ERROR,
                f"this step shape is no longer served: {NEW_SHAPE_HINT}",
                request_id,
                reason=Reason.OLD_SHAPE,
                errors=[{"loc": ["data"], "msg": NEW_SHAPE_HINT, "type": "old_shape"}],
            )
            return encode(reply), False
        try:
            msg = CLIENT_MESSAGE.validate_python(raw)
        except ValidationError as exc:
            errors = json_safe_errors(exc.errors())
            problems = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors)
            if raw["type"] == "step":
                problems += f" ({NEW_SHAPE_HINT})"
            reply = error_message(ErrorCode.VALIDATION_ERROR, problems, request_id, errors=errors)
            return encode(reply), False
        try:
            return await self._dispatch(msg)
        except ServerError as exc:
            return _error(exc, request_id), False

    async def _dispatch(self, msg: ClientMessageT) -> tuple[str | None, bool]:
        rid = msg.request_id
        if isinstance(msg, CloseMessage):
            await self.close()
            return None, True
        if self.agent_running and not isinstance(msg, StateRequest):
            raise ServerError(
                ErrorCode.EXECUTION_ERROR,
                "a black-box agent plays this socket's episode now: only state and close are "
                "served until its agent reply",
                Reason.AGENT_RUNNING,
            )
        if isinstance(msg, AgentMessage):
            episode = self._live_episode()
            self.manager.check_agent(episode)  # refusals answer at once
            self.agent = asyncio.ensure_future(self._run_agent(episode, msg))
            return None, False
        if isinstance(msg, McpMessage):
            response = await self.rpc.handle(msg.data, SocketScope(self))
            if response is None:  # a notification: JSON-RPC answers nothing
                return None, False
            return encode(McpReply(data=response, request_id=rid)), False
        if isinstance(msg, ResetMessage):
            result = await self._reset(msg.data)
            return self._observation(result, rid), False
        if isinstance(msg, StateRequest):
            state = await self.manager.state(self._live_episode())
            return encode(StateMessage(data=state, request_id=rid)), False
        action = msg.data
        if not isinstance(action, CallToolAction):  # list_tools: no reset needed
            if self.episode is None:
                listed = StepResult[ListToolsObservation](
                    observation=ListToolsObservation(tools=bundle_tools(self.manager.bundle))
                )
                return self._observation(listed, rid), False
            return self._observation(self._live_episode().list_tools(), rid), False
        out = await self.manager.step(self._live_episode(), action)
        return self._observation(out, rid), False

    @staticmethod
    def _observation(result: StepResult[Any], rid: RequestId | None) -> str:
        return encode_observation(result, rid)

    async def _run_agent(self, episode: Episode, msg: AgentMessage) -> str:
        try:
            result = await self.manager.run_agent(episode, msg.data)
        except ServerError as exc:
            return _error(exc, msg.request_id)
        except Exception as exc:  # a bug, not a refusal: answered, logged, the socket goes on
            log.exception("the agent run on episode %s failed", episode.id)
            failure = ServerError(
                ErrorCode.EXECUTION_ERROR, f"the agent run failed: {type(exc).__name__}: {exc}"
            )
            return _error(failure, msg.request_id)
        return encode(AgentReply(data=result, request_id=msg.request_id))

    async def _reset(self, data: ResetData) -> StepResult[Any]:
        task = self.manager.find_task(data)
        await self.close()  # a reset replaces this socket's episode, as in OpenEnv
        self.episode, prompt = await self.manager.open(task, data.episode_id)
        return self.episode.reset_observation(prompt)

    def _live_episode(self) -> Episode:
        episode = self.episode
        if episode is None:
            raise ServerError(
                ErrorCode.EXECUTION_ERROR,
                "no episode on this socket; send reset first",
                Reason.NO_EPISODE,
            )
        self.manager.check_live(episode)
        return episode

    async def close(self) -> None:
        """Stop a running agent (its sandbox side is killed), then close the episode."""
        agent, self.agent = self.agent, None
        if agent is not None and not agent.done():
            agent.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # _run_agent raises nothing else
                await agent
        if self.episode is not None:
            await self.manager.close(self.episode, "closed" if not self.episode.done else None)
            self.episode = None


def _error(exc: ServerError, request_id: RequestId | None) -> str:
    return encode(error_message(exc.code, str(exc), request_id, reason=exc.reason, **exc.extra))


class SocketScope:
    """A socket's JSON-RPC requests, on the socket's own episode. With ``start_on_call`` (the
    ``/mcp`` socket) a ``tools/call`` with no episode yet starts one on the default task, as
    OpenEnv's socket has its env from the start."""

    def __init__(self, conversation: SocketConversation, *, start_on_call: bool = False) -> None:
        self.conversation = conversation
        self.start_on_call = start_on_call

    async def create(self, data: ResetData) -> str:
        return await self.conversation.create(data)

    async def find(self, session_id: str | None, *, calling: bool = False) -> Episode | None:
        conversation = self.conversation
        if calling and self.start_on_call and conversation.episode is None and session_id is None:
            await conversation.create(ResetData())
        return conversation.find(session_id)

    async def close(self, session_id: str | None) -> None:
        await self.conversation.close_session(session_id)


async def serve_socket(
    websocket: WebSocket,
    conversation: SocketConversation,
    *,
    mcp: bool,
    first_reset_timeout: float,
    idle_timeout: float,
) -> None:
    """One accepted socket's life: ``/ws`` frames, or JSON-RPC ones on ``/mcp`` (``mcp``).
    The socket is closed (1008, with a reason) when no reset starts an episode within
    ``first_reset_timeout`` s of opening (``/ws`` only), or once it has been ``idle_timeout``
    s without an episode since its opening (``/mcp``) or its last episode's end. Deadlines are
    fixed points in time, not waits per frame, so frames that start no episode do not keep the
    socket; a live episode's own idle deadline wakes the loop too, so a reap during the wait is
    seen. The conversation (and so its episode) is closed when the loop ends."""
    manager = conversation.manager
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
            episode = conversation.episode
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
            # first, and the socket is served meanwhile (module docstring).
            agent = conversation.agent
            waits: set[asyncio.Future[Any]] = {receiving} if agent is None else {receiving, agent}
            done, _ = await asyncio.wait(
                waits, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED
            )
            if agent is not None and agent in done:
                if websocket.application_state != WebSocketState.CONNECTED:
                    break
                await websocket.send_text(conversation.agent_reply())
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
                reply: str | None = await conversation.handle_mcp(text)
                hang_up = False
            else:
                reply, hang_up = await conversation.handle(text)
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
        await conversation.close()


def socket_routes(
    manager: EpisodeManager,
    *,
    authorized: Callable[[WebSocket], bool],
    first_reset_timeout: float,
    idle_timeout: float,
) -> APIRouter:
    """The WebSockets ``/ws`` (OpenEnv's frames) and ``/mcp`` (JSON-RPC frames), each one
    :class:`SocketConversation` on ``manager`` served by :func:`serve_socket`. A socket that
    ``authorized`` refuses is accepted and closed at once (1008, with a reason), before any
    env is created; while the server shuts down, one is closed with 1001."""
    router = APIRouter()

    async def serve(websocket: WebSocket, *, mcp: bool) -> None:
        conversation = SocketConversation(manager)
        if not authorized(websocket):
            # Accept, then close with a reason: a close before accept reaches the client as a
            # bare HTTP 403 with no explanation.
            await websocket.accept()
            await websocket.close(POLICY_VIOLATION, "missing or wrong bearer token")
            return
        await websocket.accept()
        await serve_socket(
            websocket,
            conversation,
            mcp=mcp,
            first_reset_timeout=first_reset_timeout,
            idle_timeout=idle_timeout,
        )

    @router.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await serve(websocket, mcp=False)

    @router.websocket("/mcp")
    async def mcp_ws(websocket: WebSocket) -> None:
        await serve(websocket, mcp=True)

    return router
