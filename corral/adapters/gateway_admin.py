"""A client of the gateway's admin API: open sessions, set rewards or failures, take samples.

Everything a rollout does with a session besides talking to the model (which goes through the
session's own OpenAI endpoint, like any agent's) goes through :class:`GatewayAdmin`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp

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
    pool for every call, opened on the first call's event loop (an instance serves one loop);
    use as an async context manager or call :meth:`aclose`.

    aiohttp rather than httpx: a trainer makes four admin calls per rollout with hundreds of
    rollouts in flight, and httpx's pool scans every connection on every request (measured:
    a quarter of the trainer process's CPU at 256 rollouts in flight)."""

    def __init__(self, url: str, admin_token: str | None = None, *, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if admin_token:
            self._headers["Authorization"] = f"Bearer {admin_token}"
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection limit: the caller bounds its concurrency; idle connections are
            # kept for less than corral's servers keep them (serving.KEEP_ALIVE_S), so a reused
            # one is never being closed by the server as a request goes out.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, timeout=self._timeout, trust_env=False
            )
        return self._session

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        try:
            async with self._http().request(method, self.url + path, data=data) as answer:
                status, raw = answer.status, await answer.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            why = str(exc) or type(exc).__name__
            raise GatewayAdminError(f"the gateway at {self.url} is unreachable: {why}") from exc
        if status >= 400:
            try:
                detail = json.loads(raw)["error"]["message"]
            except Exception:
                detail = raw[:500].decode(errors="replace")
            raise GatewayAdminError(f"{method} {path}: {status} {detail}", status)
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise GatewayAdminError(f"{method} {path}: the answer is not JSON: {exc}") from exc

    async def admin_needs_token(self) -> bool:
        """Whether the gateway refuses an admin call that carries no token (one request, with
        no Authorization header, for a session that does not exist): ``False`` means anyone
        who reaches it, a session's own agent included, may set rewards or delete sessions.
        :class:`GatewayAdminError` when it cannot be reached."""
        url = f"{self.url}/sessions/corral-admin-probe"
        try:
            async with self._http().get(url, headers={"Authorization": ""}) as answer:
                return answer.status == 401
        except (TimeoutError, aiohttp.ClientError) as exc:
            why = str(exc) or type(exc).__name__
            raise GatewayAdminError(f"the gateway at {self.url} is unreachable: {why}") from exc

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
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> GatewayAdmin:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
