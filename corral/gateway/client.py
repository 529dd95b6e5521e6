"""A client of the gateway's admin API: open sessions, set rewards or failures, take samples.

Everything a rollout does with a session besides talking to the model (which goes through the
session's own OpenAI endpoint, like any agent's) goes through :class:`GatewayAdmin`.

The admin API's bodies are typed on both sides. :class:`SessionCreated` (the answer to
``POST /sessions``), :class:`RewardBody` and :class:`FailBody` are defined here and the
gateway's routes (:mod:`corral.gateway.app`) use them too; the body of ``POST /sessions`` is
:class:`~corral.gateway.options.SessionOptions`, the model the gateway validates it with.
This module imports only aiohttp, pydantic, :mod:`corral.samples` and the gateway's light
option and settings modules: never the chat-template renderer (transformers, jinja2), which
the base install has not.
"""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel, ConfigDict, ValidationError

from corral.gateway.options import SessionOptions
from corral.samples import Sample


class GatewayAdminError(Exception):
    """The gateway refused an admin call or could not be reached; ``status`` is the HTTP
    status (``None`` when no answer came)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SessionCreated(BaseModel):
    """The answer to ``POST /sessions``: the session's id, the OpenAI base URL of its own (for
    Chat Completions and Responses), the Anthropic base URL of its own (for Messages; the SDK
    appends ``/v1``), and the key that authenticates it on both."""

    model_config = ConfigDict(frozen=True)

    id: str
    base_url: str
    anthropic_base_url: str
    api_key: str


class RewardBody(BaseModel):
    """The body of ``POST /sessions/{id}/reward``."""

    model_config = ConfigDict(extra="forbid")

    reward: float


class FailBody(BaseModel):
    """The body of ``POST /sessions/{id}/fail``."""

    model_config = ConfigDict(extra="forbid")

    reason: str


class SessionSummary(BaseModel):
    """One session in ``GET /sessions``: where it stands, never its api key. ``metadata`` is
    the session's own (``SessionOptions.metadata``: a player puts the task id there)."""

    model_config = ConfigDict(frozen=True)

    id: str
    closed: bool
    age_s: float
    idle_s: float
    turns: int
    trajectories: int
    held_tokens: int
    reward: float | None
    failure: str | None
    group_index: int | None
    metadata: dict[str, Any]


class SessionPage(BaseModel):
    """The answer to ``GET /sessions?limit=N&after=ID``: up to ``limit`` sessions, oldest
    first, after the session ``after`` (the previous page's ``next``); ``next`` is None on the
    last page. ``total``: the sessions open now."""

    model_config = ConfigDict(frozen=True)

    sessions: list[SessionSummary]
    total: int
    next: str | None


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

    async def _call(self, method: str, path: str, body: BaseModel | None = None) -> Any:
        data = None if body is None else body.model_dump_json(exclude_defaults=True).encode()
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
    ) -> SessionCreated:
        """A new session; ``metadata``, ``group_index`` and ``index`` go into its samples,
        ``sampling`` overrides win over the client's values."""
        body = SessionOptions(
            metadata=metadata or {}, sampling=sampling or {}, group_index=group_index, index=index
        )
        made = await self._call("POST", "/sessions", body)
        try:
            return SessionCreated.model_validate(made)
        except ValidationError as exc:
            raise GatewayAdminError(f"POST /sessions: the answer is not a session: {exc}") from exc

    async def set_reward(self, session_id: str, reward: float) -> None:
        await self._call("POST", f"/sessions/{session_id}/reward", RewardBody(reward=reward))

    async def fail(self, session_id: str, reason: str) -> None:
        """Flag the session failed: every sample gets status ``failed`` and the reason."""
        await self._call("POST", f"/sessions/{session_id}/fail", FailBody(reason=reason))

    async def list_sessions(self, *, limit: int = 100, after: str | None = None) -> SessionPage:
        """A page of the open sessions, oldest first (:class:`SessionPage`)."""
        query = f"?limit={int(limit)}" + (f"&after={quote(after, safe='')}" if after else "")
        try:
            return SessionPage.model_validate(await self._call("GET", "/sessions" + query))
        except ValidationError as exc:
            raise GatewayAdminError(f"GET /sessions: not a session page: {exc}") from exc

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
