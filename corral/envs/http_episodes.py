"""Episodes named by id instead of held by a socket: HTTP ``/reset`` + ``/step`` + ``/state``
(:func:`http_episode_routes`) and the JSON-RPC ``/mcp`` sessions, kept by :class:`HttpEpisodes`.

They live in the server's one :class:`~corral.envs.episodes.EpisodeManager`, so they share its
capacity and its idle reaper with socket episodes. An ended episode (graded, failed, reaped)
stays known for a while, so its id answers "over" rather than "unknown".

A refused request raises :class:`~corral.envs.episodes.ServerError`; the app answers it with
:func:`error_response` (registered once, as its handler), whose status :func:`http_status`
picks.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from corral.envs.episodes import Episode, EpisodeManager, ServerError
from corral.envs.http_bodies import json_body, unless_client_leaves, validation_error
from corral.envs.protocol import (
    ErrorCode,
    ErrorData,
    ListToolsAction,
    Reason,
    ResetData,
    ResetObservation,
    StepAction,
    StepResult,
    quoted,
)

# Ended episodes remembered (for their state and a clear "over"), oldest forgotten first.
REMEMBERED_ENDED = 1024


class HttpEpisodes:
    """The episodes opened over HTTP or ``/mcp``, by id. Must be used from one event loop."""

    def __init__(self, manager: EpisodeManager) -> None:
        self.manager = manager
        self._episodes: OrderedDict[str, Episode] = OrderedDict()

    async def open(self, data: ResetData) -> tuple[Episode, StepResult[ResetObservation]]:
        """A new episode (``data`` as a reset's); its id is ``observation.episode_id``: the
        client's ``episode_id`` when given and no live episode (of any kind) has it."""
        if data.episode_id is not None and data.episode_id in self._episodes:
            old = self._episodes[data.episode_id]
            if self.manager.is_open(old):  # taken: the manager picks a fresh id
                data = data.model_copy(update={"episode_id": None})
        episode, result = await self.manager.start(data)
        self._episodes[episode.id] = episode
        self._episodes.move_to_end(episode.id)
        self._forget_ended()
        return episode, result

    def get(self, episode_id: str | None) -> Episode:
        """The episode ``episode_id`` names; ServerError ``no_episode`` for none or unknown."""
        if not episode_id:
            raise ServerError(
                ErrorCode.EXECUTION_ERROR,
                'name the episode: "episode_id" (the reset observation\'s episode_id)',
                Reason.NO_EPISODE,
            )
        episode = self._episodes.get(episode_id)
        if episode is None:
            raise ServerError(
                ErrorCode.EXECUTION_ERROR,
                f"no episode {quoted(episode_id)} on this server; POST /reset starts one",
                Reason.NO_EPISODE,
            )
        return episode

    async def close(self, episode_id: str | None) -> Episode:
        """Close and forget the episode ``episode_id`` names (ServerError as :meth:`get`)."""
        episode = self.get(episode_id)
        del self._episodes[episode.id]
        await self.manager.close(episode, "closed" if not episode.done else None)
        return episode

    def _forget_ended(self) -> None:
        ended = [i for i, e in self._episodes.items() if not self.manager.is_open(e)]
        for episode_id in ended[: max(0, len(ended) - REMEMBERED_ENDED)]:
            del self._episodes[episode_id]


# The HTTP status of a refused request, by its code and reason.
_STATUS = {
    Reason.NO_EPISODE: 404,
    Reason.TASK_NOT_FOUND: 404,
    Reason.EPISODE_DONE: 409,
    Reason.BODY_TOO_LARGE: 413,
}
_STATUS_BY_CODE = {
    ErrorCode.VALIDATION_ERROR: 422,
    ErrorCode.INVALID_JSON: 400,
    ErrorCode.UNKNOWN_TYPE: 400,
    ErrorCode.SESSION_ERROR: 410,
    ErrorCode.CAPACITY_REACHED: 503,
    ErrorCode.FACTORY_ERROR: 502,
    ErrorCode.EXECUTION_ERROR: 500,
}


def http_status(error: ServerError) -> int:
    """The HTTP status for ``error``: 404 unknown episode or task, 409 the episode is over,
    410 closed by the server, 413 a body over the cap, 422 bad request, 503 full, 502 the env
    did not start."""
    if error.reason in _STATUS:
        return _STATUS[error.reason]
    return _STATUS_BY_CODE[error.code]


def error_response(exc: ServerError) -> Response:
    """A refusal over HTTP: FastAPI's ``{"detail": ...}`` holding the error frame's data, with
    :func:`http_status`'s status."""
    data = ErrorData(message=str(exc), code=exc.code, reason=exc.reason, **exc.extra)
    body = {"detail": data.model_dump(mode="json", exclude_none=True)}
    return Response(json.dumps(body), status_code=http_status(exc), media_type="application/json")


class HttpStep(BaseModel):
    """``POST /step``'s body: OpenEnv's StepRequest (its ``timeout_s`` and ``request_id``
    accepted and ignored: the server's tool timeout applies) naming the HTTP episode."""

    model_config = ConfigDict(extra="forbid")

    action: StepAction
    episode_id: str | None = Field(default=None, max_length=255)
    timeout_s: float | None = None
    request_id: str | None = None


def http_episode_routes(episodes: HttpEpisodes, *, max_body_bytes: int) -> APIRouter:
    """``POST /reset``, ``POST /step`` and ``GET /state?episode_id=`` on ``episodes``. Bodies
    are read up to ``max_body_bytes``; a reset whose client hangs up before its episode exists
    is cancelled (its slot freed), one whose client is gone once it exists is closed at once
    (499 either way). Refusals raise ServerError, for the app's :func:`error_response`."""
    manager = episodes.manager
    router = APIRouter()

    @router.post("/reset")
    async def http_reset(request: Request) -> Response:
        body = await json_body(request, max_body_bytes, allow_empty=True)
        try:
            data = ResetData.model_validate(body if body is not None else {})
        except ValidationError as exc:
            raise validation_error(exc) from None
        opened = await unless_client_leaves(request, episodes.open(data))
        if opened is None:  # the client hung up while its env started: nobody has the id
            return Response(status_code=499)
        episode, result = opened
        if await request.is_disconnected():
            await episodes.close(episode.id)
            return Response(status_code=499)
        return _json(result)

    @router.post("/step")
    async def http_step(request: Request) -> Response:
        body = await json_body(request, max_body_bytes)
        try:
            step = HttpStep.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        episode = episodes.get(step.episode_id)
        if isinstance(step.action, ListToolsAction):
            manager.check_live(episode)
            return _json(episode.list_tools())
        return _json(await manager.step(episode, step.action))

    @router.get("/state")
    async def http_state(episode_id: str | None = None) -> Response:
        return _json(await manager.state(episodes.get(episode_id)))

    return router


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")
