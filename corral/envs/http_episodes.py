"""Episodes named by id instead of held by a socket: HTTP ``/reset`` + ``/step`` and the
JSON-RPC ``/mcp`` sessions (:class:`HttpEpisodes`).

They live in the server's one :class:`~corral.envs.episodes.EpisodeManager`, so they share its
capacity and its idle reaper with socket episodes. An ended episode (graded, failed, reaped)
stays known for a while, so its id answers "over" rather than "unknown".
"""

from __future__ import annotations

from collections import OrderedDict

from corral.envs.episodes import Episode, EpisodeManager, ServerError
from corral.envs.protocol import (
    ErrorCode,
    Reason,
    ResetData,
    ResetObservation,
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
