"""An async HTTP client of SGLang's native API, for a real SGLang server or router and for
corral's local engine alike (both speak the same API; see ``corral.engines.protocol``).

Contracts, for every method:

- Only ``corral.engines.errors`` exceptions leave the client, never a raw ``aiohttp`` one:
  the engine cannot be reached -> ``EngineUnavailable`` (names the URL); it did not answer in
  time -> ``EngineTimeout``; it answered with a non-2xx status -> ``EngineStatusError`` (an
  ``EngineProtocolError`` carrying the status and the engine's own message); it answered
  with something that is not SGLang's API (non-JSON, wrong shape) -> ``EngineProtocolError``
  saying what was wrong. ``health()`` is the one exception: it never raises.
- Retries only where they cannot run a request twice. A connection that could not be
  established (nothing was sent) is retried for every call, ``retries`` times with a short
  exponential backoff. A request that may have reached the engine (read timeout, connection
  reset after sending) is retried only for idempotent calls (the GETs, ``abort`` and
  ``flush_cache``), never for ``generate``, ``stream`` or ``update_weights_from_disk``.
- Non-2xx answers are never retried: the engine decided.
- Behind one of SGLang's routers (sglang-router, smg) the router's own failures are told
  apart from its workers' answers: "no available workers" -> ``EngineNoWorker`` (an
  ``EngineUnavailable``), "could not send to the worker" -> ``EngineUnavailable``.

Session affinity: a request's ``routing_key`` (``GenerateRequest.routing_key``, never in the
body) goes out as the ``X-SMG-Routing-Key`` header, which smg's ``consistent_hashing`` and
sglang-router's ``manual`` policy hash to pick the worker, so every request with one key
reaches the same worker. ``abort(rid)`` sends the key its request was sent with (the client
remembers it for its last ``_ROUTING_KEYS_KEPT`` requests). A plain engine ignores the header.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing, asynccontextmanager, suppress
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, overload

import aiohttp
from pydantic import BaseModel, ValidationError
from yarl import URL

from corral.engines.errors import (
    EngineError,
    EngineNoWorker,
    EngineProtocolError,
    EngineStatusError,
    EngineTimeout,
    EngineUnavailable,
)
from corral.engines.protocol import (
    AbortRequest,
    GenerateRequest,
    GenerateResponse,
    LogprobEntry,
    ModelInfo,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
)
from corral.engines.stream import StreamDelta
from corral.validation import validation_message

__all__ = ["EngineStatusError", "SGLangClient"]

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")

# SGLang's own /health may run a one-token generation and waits up to 20 s for it
# (SGLANG_HEALTH_CHECK_TIMEOUT); a health probe should not wait the full generate timeout.
_HEALTH_TIMEOUT = 30.0
_BACKOFF_FIRST = 0.1
_BACKOFF_MAX = 1.0
_MESSAGE_MAX = 500  # how much of an engine's error body goes into an exception message
# Idle pooled connections are dropped after this long: under uvicorn's default 5 s keep-alive
# (SGLang's server), so that a request is not sent on a connection the server is closing.
_KEEPALIVE_S = 4.0
_LINE_MAX = 64 * 1024 * 1024  # a stream line longer than this is not SGLang's
_JSON_HEADERS = {"Content-Type": "application/json"}
# The session-affinity header of SGLang's routers (smg's header_utils: x-smg-routing-key).
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# How many rid -> routing key pairs are kept for abort(rid): far more than are in flight.
_ROUTING_KEYS_KEPT = 4096
# The error codes of SGLang's routers (sglang-router 0.3, smg 1.x) for their own failures:
# no worker to pick, and a worker that could not be sent the request.
_ROUTER_NO_WORKER = frozenset({"no_available_workers"})
_ROUTER_UPSTREAM_FAILED = frozenset(
    {"call_upstream_connection_failed", "call_upstream_request_error"}
)
# aiohttp >= 3.10 raises ConnectionTimeoutError for a connect (or pool) timeout; 3.9 raises
# ServerTimeoutError for it and for read timeouts alike, which are then all taken as read
# timeouts: never resent for a non-idempotent call, at worst not retried.
_CONNECT_TIMEOUT: tuple[type[Exception], ...] = (
    (aiohttp.ConnectionTimeoutError,) if hasattr(aiohttp, "ConnectionTimeoutError") else ()
)
# Closings of sessions left behind in another loop, referenced until they finish.
_CLOSING: set[asyncio.Task[None]] = set()


class SGLangClient:
    """Client of SGLang's native HTTP API over one pooled HTTP/1.1 keep-alive connection pool.

    ``timeout`` bounds each read (for ``generate``, the whole generation; for ``stream``, the
    gap between two chunks) and the wait for a free pooled connection; ``connect_timeout``
    bounds establishing a connection; ``retries`` is how many times a failed connection
    attempt is retried (so up to ``retries + 1`` attempts). Proxy settings from the
    environment are ignored: an engine is a cluster-internal service, and an ``HTTP_PROXY``
    meant for package downloads must not capture it. ``api_key``: sent as ``Authorization:
    Bearer <api_key>`` on every request (SGLang's and vLLM's ``--api-key``, ``corral engine
    --token-var``); None sends none.

    The underlying ``aiohttp`` session is created on first use, inside the running event
    loop (so the client itself may be built anywhere); used from another loop later, the
    client drops the old session and opens a new one.

    Use it as an async context manager, or call ``aclose()``; a ``ValueError`` is raised at
    construction for a URL that is not ``http(s)://...`` or for negative settings.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        max_connections: int = 512,
        retries: int = 2,
        api_key: str | None = None,
    ) -> None:
        try:
            url = URL(base_url)
        except (ValueError, TypeError):
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"engine URL must be http(s)://host[:port], got {base_url!r}")
        if timeout <= 0 or connect_timeout <= 0 or max_connections < 1 or retries < 0:
            raise ValueError(
                "timeout and connect_timeout must be > 0, max_connections >= 1, retries >= 0"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.retries = retries
        # On the session, so that no request (generate, stream, abort, health, ...) goes
        # without it; not kept as an attribute of its own, so it shows in no repr.
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._timeout = self._client_timeout(timeout)
        self._urls: dict[str, URL] = {}
        self._routing_keys: OrderedDict[str, str] = OrderedDict()  # rid -> routing key
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every pooled connection. Idempotent; later calls raise ``EngineUnavailable``.

        Works whether or not a session was ever opened, and from another event loop than
        the one the session was opened in (a session whose loop is gone is just dropped).
        """
        self._closed = True
        session, loop = self._session, self._loop
        self._session = self._loop = None
        if session is not None:
            await _close_session(session, loop)

    # --- generation -------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        """``POST /generate`` with ``stream`` forced off; returns the whole answer.

        ``output_ids`` is always filled: an engine that leaves it out (older SGLang) has it
        recovered from the ``output_token_logprobs`` triples. When logprobs were asked for,
        there is exactly one per output token, else ``EngineProtocolError``. Sent once only.
        """
        # Serialised by pydantic-core: a long session's 100k prompt ids cost the stdlib's
        # json.dumps some 10 ms a turn.
        body = req.model_copy(update={"stream": False}).model_dump_json(exclude_none=True).encode()
        resp = await self._checked(
            "POST", "/generate", json_body=body, idempotent=False, headers=self._routing(req)
        )
        where = self._where("POST", "/generate")
        return _complete_output_ids(_parse(resp, GenerateResponse, where), req, where)

    async def stream(self, req: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        """``POST /generate`` with ``stream`` on; yields only the NEW tokens of each chunk.

        Works with SGLang's default cumulative chunks and with
        ``--incremental-streaming-output`` deltas alike (see ``_DeltaTracker``). The last
        delta carries ``finish_reason``. The stream must end with ``data: [DONE]``; one that
        stops before any ``finish_reason`` raises ``EngineProtocolError``, one whose
        connection breaks raises ``EngineUnavailable``, one that stalls for ``timeout``
        raises ``EngineTimeout``. Never retried once the request may have been sent.

        Closing the iterator early (``aclose()``, cancellation, or ``break`` inside
        ``contextlib.aclosing``) closes the HTTP response, which makes SGLang abort the
        request. A bare ``break`` closes it only when the generator is finalized, so wrap
        the iterator in ``aclosing`` to release the engine at once.
        """
        where = self._where("POST", "/generate")
        # Serialised by pydantic-core: a long session's 100k prompt ids cost the stdlib's
        # json.dumps some 10 ms a turn.
        body = req.model_copy(update={"stream": True}).model_dump_json(exclude_none=True).encode()
        async with self._streaming("/generate", body, where, self._routing(req)) as resp:
            tracker = _DeltaTracker(req, where)
            done = False
            async with aclosing(_sse_data(resp, where, tracker.progress)) as events:
                async for data in events:
                    if data == "[DONE]":
                        done = True
                        break
                    if tracker.finished:
                        raise EngineProtocolError(
                            f"{where}: data after the final chunk: {data!r:.200}"
                        )
                    yield tracker.delta(_parse_chunk(data, where, resp.status))
            if not done and not tracker.finished:
                raise EngineProtocolError(
                    f"{where}: stream ended without [DONE] and without a finish_reason "
                    f"after {tracker.seen_tokens} tokens"
                )

    @asynccontextmanager
    async def _streaming(
        self, path: str, body: bytes, where: str, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The open response of a streamed ``POST path`` (a non-2xx answer raises its
        ``EngineStatusError``). A body read to its end goes back to the pool; one left early
        (an error, ``aclose()``, cancellation) is closed."""
        resp = await self._open("POST", path, json_body=body, idempotent=False, headers=headers)
        complete = False
        try:
            if resp.status >= 300:
                answer = await self._read(resp, where, self.timeout)
                raise _status_error(answer, where)
            yield resp
            complete = True
        finally:
            if complete:
                # Back to the pool if the body has ended, else aiohttp closes it.
                resp.release()
            else:
                # Closing an unfinished HTTP/1.1 response drops its connection, which is how
                # the engine learns that nobody listens any more and aborts the request.
                resp.close()

    # --- control ----------------------------------------------------------------------

    async def abort(self, rid: str) -> None:
        """``POST /abort_request {rid}``, with the routing key ``rid`` was sent with (so that a
        router takes it to the same worker). Aborting an unknown or finished rid is a no-op on
        SGLang's side; retried after a reset too, since aborting twice is harmless."""
        body = AbortRequest(rid=rid).model_dump()
        key = self._routing_keys.get(rid)
        headers = {ROUTING_KEY_HEADER: key} if key is not None else None
        await self._checked(
            "POST", "/abort_request", json_body=body, idempotent=True, headers=headers
        )

    async def abort_all(self) -> None:
        """``POST /abort_request {abort_all: true}``: abort every request on the engine."""
        body = AbortRequest(abort_all=True).model_dump()
        await self._checked("POST", "/abort_request", json_body=body, idempotent=True)

    async def health(self, *, read_timeout: float | None = None) -> bool:
        """``GET /health``: True on a 2xx, False on anything else. Never raises.

        Waits at most ``read_timeout`` for the answer (default: the client's timeout, capped
        at 30 s).
        """
        limit = read_timeout if read_timeout is not None else min(self.timeout, _HEALTH_TIMEOUT)
        try:
            resp = await self._request("GET", "/health", idempotent=True, read_timeout=limit)
        except EngineError:
            return False
        except Exception:  # never raises, whatever breaks
            log.exception("health check of %s failed unexpectedly", self.base_url)
            return False
        return resp.is_success

    async def get_model_info(self) -> ModelInfo:
        """``GET /get_model_info``: model path, tokenizer path, weight version."""
        resp = await self._checked("GET", "/get_model_info", idempotent=True)
        return _parse(resp, ModelInfo, self._where("GET", "/get_model_info"))

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        read_timeout: float | None = None,
    ) -> UpdateWeightsResponse:
        """``POST /update_weights_from_disk``: load new weights in place.

        SGLang answers ``{success, message, num_paused_requests}`` with 200, or with 400 when
        ``success`` is false; either way a false ``success`` raises ``EngineError`` with the
        engine's message. ``read_timeout`` overrides the client's timeout (loading a large
        checkpoint can take minutes). Sent once only: a load may have started.
        """
        where = self._where("POST", "/update_weights_from_disk")
        body = UpdateWeightsFromDiskRequest(
            model_path=model_path, weight_version=weight_version
        ).model_dump(exclude_none=True)
        resp = await self._request(
            "POST",
            "/update_weights_from_disk",
            json_body=body,
            idempotent=False,
            read_timeout=read_timeout,
        )
        try:
            out = _parse(resp, UpdateWeightsResponse, where)
        except EngineProtocolError:
            if resp.is_success:
                raise
            raise _status_error(resp, where) from None
        if not out.success:
            raise EngineError(f"{where}: loading {model_path!r} failed: {out.message}")
        if not resp.is_success:  # success true with an error status: trust neither
            raise _status_error(resp, where)
        return out

    async def flush_cache(self) -> None:
        """``POST /flush_cache``. SGLang refuses (400) while requests are running; that
        raises ``EngineStatusError`` with its message."""
        await self._checked("POST", "/flush_cache", idempotent=True)

    # --- transport --------------------------------------------------------------------

    def _where(self, method: str, path: str) -> str:
        return f"{method} {self.base_url}{path}"

    def _routing(self, req: GenerateRequest) -> dict[str, str] | None:
        """The routing-key header for ``req`` (None without a key); remembers it for
        ``abort(req.rid)``."""
        key = req.routing_key
        if key is None:
            return None
        if req.rid is not None:
            self._routing_keys[req.rid] = key
            self._routing_keys.move_to_end(req.rid)
            while len(self._routing_keys) > _ROUTING_KEYS_KEPT:
                self._routing_keys.popitem(last=False)
        return {ROUTING_KEY_HEADER: key}

    def _client_timeout(self, read_timeout: float) -> aiohttp.ClientTimeout:
        # ``connect`` bounds waiting for a pooled connection plus connecting (httpx's pool
        # timeout, which was the read timeout); ``sock_connect`` bounds the TCP connect alone.
        return aiohttp.ClientTimeout(
            total=None,
            connect=read_timeout,
            sock_connect=self.connect_timeout,
            sock_read=read_timeout,
        )

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url

    def _get_session(self, where: str) -> aiohttp.ClientSession:
        """The session of the running loop, opened on first use (never outside a loop)."""
        if self._closed:
            raise EngineUnavailable(f"{where}: the client was closed")
        loop = asyncio.get_running_loop()
        session = self._session
        if session is not None and self._loop is loop and not session.closed:
            return session
        if session is not None:  # opened in another loop (or closed under us): let it go
            old_loop = self._loop
            self._session = self._loop = None
            if old_loop is not loop:
                task = loop.create_task(_close_session(session, old_loop))
                _CLOSING.add(task)
                task.add_done_callback(_CLOSING.discard)
        connector = aiohttp.TCPConnector(
            limit=self.max_connections,
            keepalive_timeout=_KEEPALIVE_S,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            trust_env=False,
            auto_decompress=True,
            headers=self._auth,
        )
        # aiohttp silently resends a GET once when a connection breaks; the retry policy is
        # ours alone (see the module docstring), so that it counts every attempt.
        if hasattr(session, "_retry_connection"):
            session._retry_connection = False
        self._session, self._loop = session, loop
        return session

    async def _checked(
        self,
        method: str,
        path: str,
        *,
        json_body: dict[str, Any] | bytes | None = None,
        idempotent: bool,
        headers: Mapping[str, str] | None = None,
    ) -> _Answer:
        """``_request`` that turns a non-2xx answer into ``EngineStatusError`` (or, for a
        router's own failure, ``EngineUnavailable``)."""
        resp = await self._request(
            method, path, json_body=json_body, idempotent=idempotent, headers=headers
        )
        if not resp.is_success:
            raise _status_error(resp, self._where(method, path))
        return resp

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: dict[str, Any] | bytes | None = None,
        idempotent: bool,
        read_timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> _Answer:
        """Send one request and read its whole answer, with the retry policy of the module
        docstring. Returns the answer whatever its status. Raises ``EngineUnavailable`` /
        ``EngineTimeout`` / ``EngineError``, never an ``aiohttp`` exception."""
        return await self._send(
            method,
            path,
            json_body=json_body,
            idempotent=idempotent,
            read_timeout=read_timeout,
            headers=headers,
        )

    async def _open(
        self,
        method: str,
        path: str,
        *,
        json_body: dict[str, Any] | bytes | None = None,
        idempotent: bool,
        headers: Mapping[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        """``_request`` that returns once the head has arrived, body unread: the caller must
        ``release()`` or ``close()`` the response."""
        return await self._send(
            method, path, json_body=json_body, idempotent=idempotent, stream=True, headers=headers
        )

    @overload
    async def _send(
        self,
        method: str,
        path: str,
        *,
        json_body: dict[str, Any] | bytes | None,
        idempotent: bool,
        read_timeout: float | None = ...,
        stream: Literal[False] = ...,
        headers: Mapping[str, str] | None = ...,
    ) -> _Answer: ...

    @overload
    async def _send(
        self,
        method: str,
        path: str,
        *,
        json_body: dict[str, Any] | bytes | None,
        idempotent: bool,
        read_timeout: float | None = ...,
        stream: Literal[True],
        headers: Mapping[str, str] | None = ...,
    ) -> aiohttp.ClientResponse: ...

    async def _send(
        self,
        method: str,
        path: str,
        *,
        json_body: dict[str, Any] | bytes | None,
        idempotent: bool,
        read_timeout: float | None = None,
        stream: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> _Answer | aiohttp.ClientResponse:
        where = self._where(method, path)
        url = self._url(path)
        budget = self.timeout if read_timeout is None else read_timeout
        timeout = self._timeout if read_timeout is None else self._client_timeout(read_timeout)
        data: bytes | None = None
        sent: Mapping[str, str] | None = headers
        if json_body is not None:
            data = (
                json_body
                if isinstance(json_body, bytes)
                else json.dumps(json_body, ensure_ascii=False, separators=(",", ":")).encode()
            )
            sent = _JSON_HEADERS if headers is None else {**_JSON_HEADERS, **headers}
        attempt = 0
        while True:
            session = self._get_session(where)
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                resp = await session.request(
                    method,
                    url,
                    data=data,
                    headers=sent,
                    timeout=timeout,
                    allow_redirects=False,
                )
                if stream:
                    return resp
                try:
                    body = await resp.read()
                finally:
                    resp.release()  # closes the connection instead if the body was not read
                return _Answer(resp.status, resp.reason or "", body, resp.charset)
            except _CONNECT_TIMEOUT as exc:
                if loop.time() - started >= budget:
                    # Nothing was sent, but every pooled connection stayed busy for the whole
                    # timeout: the client is saturated, and retrying would only queue longer.
                    raise EngineTimeout(
                        f"{where}: no free pooled connection to {self.base_url} within "
                        f"{budget}s (raise max_connections?)"
                    ) from exc
                error: EngineError = EngineUnavailable(
                    f"{where}: cannot connect to the engine at {self.base_url}: {_describe(exc)}"
                )
                retry = True
            except aiohttp.ClientConnectorError as exc:
                # Nothing reached the engine: safe to try again whatever the call.
                error = EngineUnavailable(
                    f"{where}: cannot connect to the engine at {self.base_url}: {_describe(exc)}"
                )
                retry = True
            except TimeoutError as exc:  # aiohttp's read timeouts are TimeoutErrors too
                error = EngineTimeout(f"{where}: no answer within {budget}s: {_describe(exc)}")
                retry = idempotent
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
                # Reset or closed after (part of) the request went out: the engine may be
                # running it, so only an idempotent call may be sent again.
                error = EngineUnavailable(
                    f"{where}: connection to the engine at {self.base_url} lost: {_describe(exc)}"
                )
                retry = idempotent
            except aiohttp.ClientResponseError as exc:  # not HTTP/1.1 (bad status line, ...)
                raise EngineProtocolError(
                    f"{where}: malformed HTTP answer: {_describe(exc)}"
                ) from exc
            except aiohttp.ClientError as exc:  # anything else aiohttp may invent
                raise EngineError(f"{where}: {_describe(exc)}") from exc
            if not retry or attempt >= self.retries:
                raise error
            delay = min(_BACKOFF_FIRST * 2**attempt, _BACKOFF_MAX)
            attempt += 1
            # DEBUG: a retry that succeeds is not news, and one that fails is reported once,
            # by whoever gets the error (the gateway's line for the request, a CLI's).
            log.debug(
                "%s (attempt %d of %d, retrying in %.2fs)", error, attempt, self.retries + 1, delay
            )
            await asyncio.sleep(delay)

    async def _read(self, resp: aiohttp.ClientResponse, where: str, budget: float) -> _Answer:
        """The rest of a streamed response's body (an error answer), errors mapped."""
        try:
            body = await resp.read()
        except TimeoutError as exc:
            raise EngineTimeout(f"{where}: no answer within {budget}s: {_describe(exc)}") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(
                f"{where}: connection to the engine at {self.base_url} lost: {_describe(exc)}"
            ) from exc
        return _Answer(resp.status, resp.reason or "", body, resp.charset)


class _Answer:
    """A whole HTTP answer: status, reason and body (what the parsers need of it)."""

    __slots__ = ("body", "charset", "reason_phrase", "status_code")

    def __init__(self, status: int, reason: str, body: bytes, charset: str | None) -> None:
        self.status_code = status
        self.reason_phrase = reason
        self.body = body
        self.charset = charset

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` if it is not."""
        return json.loads(self.body)

    @property
    def text(self) -> str:
        try:
            return self.body.decode(self.charset or "utf-8", errors="replace")
        except LookupError:  # an unknown charset
            return self.body.decode("utf-8", errors="replace")


async def _close_session(
    session: aiohttp.ClientSession, loop: asyncio.AbstractEventLoop | None
) -> None:
    """Close ``session``, opened in ``loop``, from whatever loop runs now."""
    if session.closed:
        return
    current = asyncio.get_running_loop()
    if loop is None or loop is current:
        await session.close()
    elif not loop.is_closed() and loop.is_running():  # alive in another thread: close there
        asyncio.run_coroutine_threadsafe(session.close(), loop)
    else:
        # Its loop is gone (or stopped): nothing can be awaited there any more. Closing marks
        # the session and its connector closed without touching a closed loop; what it
        # cannot finish is dropped.
        with suppress(Exception):
            await session.close()


# --- streaming --------------------------------------------------------------------------


class _DeltaTracker:
    """Turns SGLang stream chunks into ``StreamDelta``s holding only the new tokens.

    Each per-token field (``output_ids``, ``output_token_logprobs``,
    ``output_top_logprobs``) is judged on its own against ``meta_info.completion_tokens``
    (the running total), because SGLang versions differ: by default every field is
    cumulative; with ``--incremental-streaming-output`` every field is a delta; older
    versions with ``--stream-output`` sent delta ``output_ids`` next to cumulative logprobs.
    A field whose length is the total is cumulative (its new part is the tail after the
    tokens already seen); one whose length is total minus seen is a delta. Either reading
    agrees on the first chunk; any other length raises ``EngineProtocolError``.
    """

    def progress(self) -> str:
        """How far the stream got, for an error message."""
        return f" after {self.seen_tokens} tokens"

    def __init__(self, req: GenerateRequest, where: str) -> None:
        self._want_logprobs = req.return_logprob
        self._want_top = req.return_logprob and req.top_logprobs_num > 0
        self._where = where
        self.seen_tokens = 0
        self.finished = False

    def delta(self, chunk: GenerateResponse) -> StreamDelta:
        meta = chunk.meta_info
        total = meta.completion_tokens
        if total < self.seen_tokens:
            raise EngineProtocolError(
                f"{self._where}: completion_tokens went back from {self.seen_tokens} to {total}"
            )
        logprobs: list[LogprobEntry] = []
        if self._want_logprobs:
            logprobs = self._new(meta.output_token_logprobs, total, "output_token_logprobs")
        if chunk.output_ids or not logprobs:
            ids = self._new(chunk.output_ids, total, "output_ids")
        else:  # no output_ids in the chunk (older SGLang): the triples carry the ids
            ids = [entry[1] for entry in logprobs]
        if self._want_logprobs and len(logprobs) != len(ids):
            raise EngineProtocolError(
                f"{self._where}: {len(ids)} new tokens but {len(logprobs)} new logprobs"
            )
        top = (
            self._new(meta.output_top_logprobs, total, "output_top_logprobs")
            if (self._want_top)
            else []
        )
        self.seen_tokens = total
        self.finished = meta.finish_reason is not None
        return StreamDelta(
            token_ids=ids,
            logprobs=[entry[0] for entry in logprobs],
            top_logprobs=top,
            finish_reason=meta.finish_reason,
            weight_version=meta.weight_version,
            prompt_tokens=meta.prompt_tokens,
            completion_tokens=total,
        )

    def _new(self, items: list[_T], total: int, field: str) -> list[_T]:
        if len(items) == total:  # cumulative: everything so far
            return items[self.seen_tokens :]
        if self.seen_tokens + len(items) == total:  # incremental: only the new part
            return items
        raise EngineProtocolError(
            f"{self._where}: chunk has {len(items)} {field} with completion_tokens={total} "
            f"after {self.seen_tokens} tokens; neither cumulative nor incremental"
        )


async def _sse_data(
    resp: aiohttp.ClientResponse, where: str, progress: Callable[[], str] = lambda: ""
) -> AsyncGenerator[str, None]:
    """Yield the ``data`` of each server-sent event of ``resp``; read errors raised as
    ``EngineTimeout`` / ``EngineUnavailable``, their message ending with ``progress()`` (how
    far the stream got, e.g. " after 12 tokens").

    Events end at a blank line; several ``data:`` lines of one event are joined with
    newlines (the SSE rule); comments and other fields are skipped. An event left open at
    the end of the body is still delivered (SGLang always closes them, others may not).
    """
    lines: list[str] = []
    try:
        async for line in _body_lines(resp.content, where):
            if not line:
                if lines:
                    yield "\n".join(lines)
                    lines = []
                continue
            if line.startswith(b"data:"):
                value = line[6:] if line.startswith(b"data: ") else line[5:]
                lines.append(value.decode("utf-8", errors="replace"))
            # Anything else (": comment", "event:", "id:", "retry:") carries no payload.
        if lines:
            yield "\n".join(lines)
    except TimeoutError as exc:  # aiohttp's read timeouts are TimeoutErrors too
        raise EngineTimeout(
            f"{where}: no stream chunk within the read timeout{progress()}: {_describe(exc)}"
        ) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise EngineUnavailable(
            f"{where}: connection lost mid-stream{progress()}: {_describe(exc)}"
        ) from exc


async def _body_lines(content: aiohttp.StreamReader, where: str) -> AsyncGenerator[bytes, None]:
    """The lines of a body, without their ending (LF, CRLF or CR, as SSE allows), however
    the network split them into chunks. Splits bytes, so that a line is never cut inside a
    UTF-8 character, nor at a Unicode line separator inside a JSON string."""
    parts: list[bytes] = []  # the pieces of an unfinished line
    size = 0
    skip_lf = False  # the last chunk ended with a CR: a LF opening this one is its CRLF
    async for piece in content.iter_any():
        chunk = piece
        if skip_lf:
            skip_lf = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if b"\r" in chunk:
            skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in chunk:
            if chunk:
                parts.append(chunk)
                size += len(chunk)
                if size > _LINE_MAX:
                    raise EngineProtocolError(
                        f"{where}: a stream line longer than {_LINE_MAX} bytes: not SGLang's"
                    )
            continue
        if parts:
            parts.append(chunk)
            chunk = b"".join(parts)
        *complete, last = chunk.split(b"\n")
        for line in complete:
            yield line
        parts = [last] if last else []
        size = len(last)
    if parts:
        yield b"".join(parts)


def _parse_chunk(data: str, where: str, status_code: int) -> GenerateResponse:
    try:
        raw = json.loads(data)
    except ValueError:
        raise EngineProtocolError(f"{where}: stream chunk is not JSON: {data!r:.200}") from None
    if isinstance(raw, dict) and "error" in raw and "meta_info" not in raw:
        # SGLang reports a failure inside a started stream as {"error": {"message": ...}}.
        message = _error_message(raw) or json.dumps(raw)[:_MESSAGE_MAX]
        raise EngineStatusError(
            f"{where}: the engine failed mid-stream: {message}",
            status_code=status_code,
            engine_message=message,
        )
    return _validate(raw, GenerateResponse, where, what="stream chunk")


# --- parsing ----------------------------------------------------------------------------


def _parse(resp: _Answer, model: type[_M], where: str, *, api: str = "SGLang") -> _M:
    """The body of ``resp`` as ``model`` (a type of ``api``'s, for the message);
    ``EngineProtocolError`` saying what is wrong."""
    try:
        raw = resp.json()
    except ValueError:
        raise EngineProtocolError(
            f"{where}: HTTP {resp.status_code} answer is not JSON: {resp.text[:200]!r}"
        ) from None
    return _validate(raw, model, where, what="answer", api=api)


def _validate(raw: object, model: type[_M], where: str, *, what: str, api: str = "SGLang") -> _M:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = validation_message(exc, root="<root>", limit=5)
        raise EngineProtocolError(
            f"{where}: {what} is not {api}'s {model.__name__}: {problems}"
        ) from None


def _complete_output_ids(
    out: GenerateResponse, req: GenerateRequest, where: str
) -> GenerateResponse:
    logprobs = out.meta_info.output_token_logprobs
    if not out.output_ids and logprobs:
        out = out.model_copy(update={"output_ids": [entry[1] for entry in logprobs]})
    if not out.output_ids and out.meta_info.completion_tokens > 0:
        raise EngineProtocolError(
            f"{where}: {out.meta_info.completion_tokens} tokens generated but the answer has "
            "neither output_ids nor output_token_logprobs"
        )
    if req.return_logprob and len(logprobs) != len(out.output_ids):
        raise EngineProtocolError(
            f"{where}: {len(out.output_ids)} output tokens but {len(logprobs)} logprobs"
        )
    return out


def _error_message(raw: object) -> str | None:
    """The message in an engine's error body, in any of the shapes SGLang uses:
    ``{"error": {"message"}}``, ``{"error": "..."}``, ``{"message"}`` (its OpenAI-style
    ErrorResponse and update-weights answers), ``{"detail"}`` (FastAPI)."""
    if not isinstance(raw, dict):
        return None
    error = raw.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error
    for key in ("message", "detail"):
        value = raw.get(key)
        if isinstance(value, str) and value:
            return value
        if value is not None and key == "detail":
            return json.dumps(value)[:_MESSAGE_MAX]
    return None


def _status_error(resp: _Answer, where: str) -> EngineError:
    """``EngineStatusError`` for a non-2xx answer, with the engine's message; for a router's
    own failure (its error ``code``), ``EngineNoWorker`` / ``EngineUnavailable``. ``resp``
    must have been read."""
    try:
        raw = resp.json()
    except ValueError:
        raw = None
    message = _error_message(raw)
    error = raw.get("error") if isinstance(raw, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and resp.status_code >= 500:
        if code in _ROUTER_NO_WORKER:
            return EngineNoWorker(
                f"{where}: HTTP {resp.status_code}: the router has no healthy worker: {message}"
            )
        if code in _ROUTER_UPSTREAM_FAILED:
            return EngineUnavailable(
                f"{where}: HTTP {resp.status_code}: the router could not reach its worker: "
                f"{message}"
            )
    if message is None:
        message = resp.text.strip()[:_MESSAGE_MAX] or resp.reason_phrase
    return EngineStatusError(
        f"{where}: HTTP {resp.status_code}: {message}",
        status_code=resp.status_code,
        engine_message=message,
    )


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
