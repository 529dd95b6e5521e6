"""A live gateway as a viewer source: one session at a time, by id, through its admin API.

The page lists the gateway's open sessions (``GET /sessions``, a page at a time: the newest
:data:`LISTED` at most) and opens one, by a click or by its id, as an episode: the conversation
rebuilt from its turns, its reward or failure, its samples and every fork. The
admin token is read here from the variable named on the command line and never leaves this
process; the session view the gateway returns never holds the session's api key, and
everything is scrubbed once more (:mod:`corral.viewer.redact`).
"""

from __future__ import annotations

from typing import Any

from corral.gateway.client import GatewayAdmin, GatewayAdminError
from corral.viewer.pieces import Pieces
from corral.viewer.reader import sample_summary, sample_view
from corral.viewer.redact import scrub

# How many sessions the page lists (the newest; the gateway may hold up to 10,000 by default).
LISTED = 1000


class GatewaySourceError(Exception):
    """The gateway refused or could not be reached."""


class GatewaySource:
    """The gateway at ``url`` with ``admin_token`` (``None``: an open gateway)."""

    def __init__(self, url: str, admin_token: str | None) -> None:
        self.url = url.rstrip("/")
        self._admin = GatewayAdmin(self.url, admin_token)

    async def sessions(self) -> dict[str, Any]:
        """The open sessions, newest first, at most :data:`LISTED`: ``{"sessions": [...],
        "total": n}``, each a summary row (id, task id, turns, reward, failure, age)."""
        rows: list[dict[str, Any]] = []
        after: str | None = None
        try:
            while True:
                page = await self._admin.list_sessions(limit=1000, after=after)
                rows.extend(s.model_dump() for s in page.sessions)
                rows = rows[-LISTED:]
                if page.next is None:
                    break
                after = page.next
        except GatewayAdminError as exc:
            raise GatewaySourceError(str(exc)) from None
        listed = [
            {
                "id": r["id"],
                "task_id": (r["metadata"] or {}).get("task_id"),
                "turns": r["turns"],
                "trajectories": r["trajectories"],
                "reward": r["reward"],
                "failure": r["failure"],
                "age_s": r["age_s"],
                "closed": r["closed"],
            }
            for r in reversed(rows)
        ]
        return scrub({"sessions": listed, "total": page.total})

    async def session(self, session_id: str) -> dict[str, Any]:
        """The session in the shape of :func:`corral.viewer.reader.episode_detail`."""
        try:
            view = await self._admin.view(session_id)
            samples = [s.model_dump() for s in await self._admin.samples(session_id)]
        except GatewayAdminError as exc:
            raise GatewaySourceError(str(exc)) from None
        meta = (view.get("options") or {}).get("metadata") or {}
        failure = view.get("failure")
        record = {
            "task_id": meta.get("task_id", session_id),
            "session_id": session_id,
            "reward": view.get("reward"),
            "failed": failure is not None,
            "reason": failure,
            "messages": conversation(view.get("turns") or []),
            "drift": view.get("drift"),
            "metadata": meta,
        }
        return scrub(
            {
                "set": None,
                "line": None,
                "session": session_id,
                "summary": {"task_id": record["task_id"], "session_id": session_id},
                "weight_version": None,
                "group_by": None,
                "record": record,
                "samples": [sample_summary(s, n) for n, s in enumerate(samples)],
                "spans": {"kind": "sums", "spans": []},
                "transcript": False,
            }
        )

    async def sample(
        self, session_id: str, number: int, pieces: Pieces | None = None
    ) -> dict[str, Any]:
        try:
            samples = await self._admin.samples(session_id)
        except GatewayAdminError as exc:
            raise GatewaySourceError(str(exc)) from None
        if not 0 <= number < len(samples):
            raise GatewaySourceError(f"session {session_id} has no sample {number}")
        view = sample_view(samples[number].model_dump(), pieces)
        view.update(session=session_id, number=number, samples=len(samples))
        return view

    async def aclose(self) -> None:
        await self._admin.aclose()


def conversation(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first trajectory's conversation from a session view's turns: each turn's new
    messages, then the model's reply (turns of later trajectories are forks of it)."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        if turn.get("trajectory") != 0:
            continue
        messages.extend(m for m in turn.get("messages") or [] if isinstance(m, dict))
        response = turn.get("response")
        if isinstance(response, dict):
            messages.append({"role": "assistant", **response})
    return messages
