"""One WebSocket's conversation with the env server (:class:`Session`): frames in, replies out.

Parses each frame (:mod:`corral.envs.protocol`), dispatches it to the socket's episode
(:mod:`corral.envs.episodes`) and encodes the reply; it never touches the socket itself.
"""

from __future__ import annotations

import json
import time

from pydantic import ValidationError

from corral.envs.episodes import SHUTDOWN_REASON, Episode, EpisodeManager, ServerError
from corral.envs.protocol import (
    CLIENT_MESSAGE,
    CLIENT_TYPES,
    CallTool,
    CloseMessage,
    ErrorCode,
    ObservationData,
    ObservationMessage,
    RequestId,
    ResetMessage,
    StateMessage,
    StateRequest,
    StepMessage,
    encode,
    error_message,
)


class Session:
    """One WebSocket's conversation: at most one episode at a time; turns messages into
    replies. Closing the session (or the socket) closes its episode."""

    def __init__(self, manager: EpisodeManager) -> None:
        self.manager = manager
        self.episode: Episode | None = None

    async def handle(self, text: str) -> tuple[str | None, bool]:
        """The reply frame to one client frame (None for none), and whether to hang up."""
        request_id: RequestId | None = None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            return encode(error_message(ErrorCode.INVALID_JSON, f"not JSON: {exc.msg}")), False
        if not isinstance(raw, dict):
            reply = error_message(ErrorCode.INVALID_JSON, "a message must be a JSON object")
            return encode(reply), False
        if isinstance(raw.get("request_id"), str | int):
            request_id = raw["request_id"]  # echoed even when the rest is malformed
        if raw.get("type") not in CLIENT_TYPES:
            message = f"unknown message type {raw.get('type')!r}; expected one of {CLIENT_TYPES}"
            return encode(error_message(ErrorCode.UNKNOWN_TYPE, message, request_id)), False
        try:
            msg = CLIENT_MESSAGE.validate_python(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            reply = error_message(ErrorCode.VALIDATION_ERROR, problems, request_id)
            return encode(reply), False
        try:
            return await self._dispatch(msg)
        except ServerError as exc:
            reply = error_message(exc.code, str(exc), request_id, **exc.extra)
            return encode(reply), False

    async def _dispatch(
        self, msg: ResetMessage | StepMessage | StateRequest | CloseMessage
    ) -> tuple[str | None, bool]:
        rid = msg.request_id
        if isinstance(msg, CloseMessage):
            await self.close()
            return None, True
        if isinstance(msg, ResetMessage):
            task = self.manager.find_task(msg.data)
            await self.close()  # a reset replaces this socket's episode, as in OpenEnv
            self.episode, prompt = await self.manager.open(task)
            obs = self.episode.observation(prompt, tools=self.episode.tools)
            return encode(
                ObservationMessage(data=ObservationData(observation=obs), request_id=rid)
            ), False
        episode = self._live_episode()
        if isinstance(msg, StateRequest):
            state = episode.final_state
            if state is None:
                state = await episode._run(episode.env.state(), limit_s=self.manager.tool_timeout)
            data = {"episode_id": episode.id, "step_count": episode.steps, "done": episode.done}
            data.update(task_id=episode.task.id, turn=episode.turn, status=episode.status)
            data["env"] = state
            return encode(StateMessage(data=data, request_id=rid)), False
        if msg.data.list_tools is not None:
            obs = episode.observation(tools=episode.tools)
            return encode(
                ObservationMessage(data=ObservationData(observation=obs), request_id=rid)
            ), False
        assert msg.data.call_tool is not None  # StepAction holds exactly one action
        return await self._step(episode, msg.data.call_tool, rid), False

    async def _step(self, episode: Episode, call: CallTool, rid: RequestId | None) -> str:
        metrics = self.manager.metrics
        episode.busy = True
        started = time.perf_counter()
        try:
            data = await episode.step(call, self.manager.tool_timeout)
        except ServerError as exc:
            metrics.steps.labels(outcome=exc.code.value).inc()
            if episode.done:
                await self.manager.close(episode)
            raise
        finally:
            episode.busy = False
            episode.last_active = time.monotonic()
            metrics.step_seconds.observe(time.perf_counter() - started)
        metrics.steps.labels(outcome="tool_error" if data.observation.tool_error else "ok").inc()
        if data.done:
            # The slot is free once graded; the episode object stays so later steps get
            # EPISODE_DONE rather than NO_EPISODE.
            await self.manager.close(episode)
        return encode(ObservationMessage(data=data, request_id=rid))

    def _live_episode(self) -> Episode:
        episode = self.episode
        if episode is None:
            raise ServerError(ErrorCode.NO_EPISODE, "no episode on this socket; send reset first")
        if episode.closed_as == "shutdown":
            raise ServerError(ErrorCode.SESSION_ERROR, SHUTDOWN_REASON)
        if episode.closed_as == "reaped":
            raise ServerError(
                ErrorCode.SESSION_ERROR,
                f"the episode was closed after {self.manager.idle_timeout:g} s idle; reset again",
            )
        return episode

    async def close(self) -> None:
        if self.episode is not None:
            await self.manager.close(self.episode, "closed" if not self.episode.done else None)
            self.episode = None
