"""A client of the gateway's admin API: open sessions, set rewards or failures, take samples.

Everything a rollout does with a session besides talking to the model (which goes through the
session's own OpenAI endpoint, like any agent's) goes through :class:`GatewayAdmin`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from corral.gateway.samples import Sample


class GatewayAdminError(Exception):
    """The gateway refused an admin call or could not be reached; ``status`` is the HTTP
    status (``None`` when no answer came)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SessionHandle:
    """A session: its id, the OpenAI base URL of its own, and the key that authenticates it."""

    id: str
    base_url: str
    api_key: str


class GatewayAdmin:
    """Admin calls to the gateway at ``url`` (``admin_token`` when it has one). One connection
    pool for every call; use as an async context manager or call :meth:`aclose`."""

    def __init__(self, url: str, admin_token: str | None = None, *, timeout: float = 30.0):
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            answer = await self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise GatewayAdminError(f"the gateway at {self.url} is unreachable: {exc}") from exc
        if answer.status_code >= 400:
            try:
                detail = answer.json()["error"]["message"]
            except Exception:
                detail = answer.text[:500]
            raise GatewayAdminError(
                f"{method} {path}: {answer.status_code} {detail}", answer.status_code
            )
        return answer.json()

    async def open_session(
        self,
        *,
        metadata: dict[str, Any] | None = None,
        group_index: int | None = None,
        index: int | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> SessionHandle:
        """A new session; ``metadata``, ``group_index`` and ``index`` go into its samples,
        ``sampling`` overrides win over the client's values."""
        body: dict[str, Any] = {"metadata": metadata or {}, "sampling": sampling or {}}
        if group_index is not None:
            body["group_index"] = group_index
        if index is not None:
            body["index"] = index
        made = await self._call("POST", "/sessions", body)
        return SessionHandle(made["id"], made["base_url"], made["api_key"])

    async def set_reward(self, session_id: str, reward: float) -> None:
        await self._call("POST", f"/sessions/{session_id}/reward", {"reward": reward})

    async def fail(self, session_id: str, reason: str) -> None:
        """Flag the session failed: every sample gets status ``failed`` and the reason."""
        await self._call("POST", f"/sessions/{session_id}/fail", {"reason": reason})

    async def view(self, session_id: str) -> dict[str, Any]:
        """The session's turns, trajectories and drift report."""
        view: dict[str, Any] = await self._call("GET", f"/sessions/{session_id}")
        return view

    async def samples(self, session_id: str) -> list[Sample]:
        return [Sample(**s) for s in await self._call("GET", f"/sessions/{session_id}/samples")]

    async def close_session(self, session_id: str) -> None:
        """Delete the session; one already gone is fine."""
        try:
            await self._call("DELETE", f"/sessions/{session_id}")
        except GatewayAdminError as exc:
            if exc.status != 404:
                raise

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> GatewayAdmin:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
