"""The gateway's HTTP layer: routes, auth, body limits and error shapes. Logic lives elsewhere.

``build_gateway_app`` wires a :class:`~corral.gateway.sessions.SessionStore` and a
:class:`~corral.gateway.chat.ChatService` behind OpenAI's chat-completions API and the
session-management API of DESIGN.md ("Gateway API").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.engines.client import EngineClient
from corral.engines.errors import EngineError
from corral.gateway.chat import Answer, ChatService, engine_error
from corral.gateway.errors import GatewayError, bad_request
from corral.gateway.openai_types import ChatCompletionRequest
from corral.gateway.sessions import (
    Session,
    SessionClosed,
    SessionNotFound,
    SessionOptions,
    SessionStore,
    StoreFull,
)
from corral.gateway.settings import GatewaySettings

T = TypeVar("T")
Handler = Callable[..., Awaitable[Response]]

# The OpenAI SDKs (Stainless-generated) send this on retries of the same request.
RETRY_HEADER = "x-stainless-retry-count"
REAP_INTERVAL_S = 30.0


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float


class FailBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def build_gateway_app(
    settings: GatewaySettings,
    engine: EngineClient,
    service: ChatService,
    *,
    store: SessionStore | None = None,
) -> Starlette:
    """The gateway app. ``settings.admin_token`` None leaves session management open (local
    use only); otherwise every management route needs it as a bearer token."""
    store = store or SessionStore(
        max_sessions=settings.max_sessions,
        max_held_tokens=settings.max_held_tokens,
        default_ttl_s=settings.session_ttl_s,
        decode=lambda ids: str(service.tokenizer.decode(list(ids), skip_special_tokens=False)),
    )
    registry = CollectorRegistry()
    requests_total = Counter(
        "corral_gateway_requests",
        "Chat completion requests by outcome",
        ["outcome"],
        registry=registry,
    )
    registry.register(_StoreCollector(store))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        reaper = asyncio.create_task(_reap_forever(store))
        try:
            yield
        finally:
            reaper.cancel()
            await engine.aclose()

    # Plain Starlette, not FastAPI: every handler parses its own body (to answer with
    # OpenAI-style 400s), so FastAPI's extra layers would only add cost on the hot path.
    routes: list[Route] = []

    def route(path: str, method: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            async def endpoint(request: Request) -> Response:
                return await handler(request, **request.path_params)

            routes.append(Route(path, endpoint, methods=[method]))
            return handler

        return register

    async def _gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def _engine_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, EngineError)
        err = engine_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    def require_admin(request: Request) -> None:
        if settings.admin_token is None:
            return
        if not hmac.compare_digest(_bearer(request), settings.admin_token):
            raise GatewayError(
                401,
                "this route needs the gateway's admin token as a bearer token",
                type="authentication_error",
                code="invalid_api_key",
            )

    def session_for(session_id: str) -> Session:
        try:
            return store.get(session_id)
        except SessionNotFound as exc:
            raise GatewayError(
                404, str(exc), type="not_found_error", code="session_not_found"
            ) from None

    # -- session management ----------------------------------------------------------------

    @route("/sessions", "POST")
    async def create_session(request: Request) -> JSONResponse:
        require_admin(request)
        raw = await request.body()
        options = _parse(SessionOptions, raw) if raw.strip() else SessionOptions()
        try:
            session = store.create(options)
        except StoreFull as exc:
            raise GatewayError(429, str(exc), type="rate_limit_error", code="store_full") from None
        base_url = str(request.base_url).rstrip("/") + f"/sessions/{session.id}/v1"
        return JSONResponse(
            {"id": session.id, "base_url": base_url, "api_key": session.api_key},
            status_code=201,
        )

    @route("/sessions/{session_id}", "GET")
    async def get_session(request: Request, session_id: str) -> JSONResponse:
        require_admin(request)
        return JSONResponse(session_for(session_id).view())

    @route("/sessions/{session_id}/reward", "POST")
    async def set_reward(request: Request, session_id: str) -> JSONResponse:
        require_admin(request)
        body = _parse(RewardBody, await request.body())
        session = session_for(session_id)
        try:
            session.set_reward(body.reward)
        except ValueError as exc:
            raise bad_request(str(exc), param="reward") from None
        return JSONResponse({"id": session_id, "reward": session.reward})

    @route("/sessions/{session_id}/fail", "POST")
    async def fail_session(request: Request, session_id: str) -> JSONResponse:
        require_admin(request)
        body = _parse(FailBody, await request.body())
        session_for(session_id).mark_failed(body.reason)
        return JSONResponse({"id": session_id, "failure": body.reason})

    @route("/sessions/{session_id}/samples", "GET")
    async def get_samples(request: Request, session_id: str) -> JSONResponse:
        require_admin(request)
        samples = session_for(session_id).samples()
        return JSONResponse([s.model_dump() for s in samples])

    @route("/sessions/{session_id}", "DELETE")
    async def delete_session(request: Request, session_id: str) -> JSONResponse:
        require_admin(request)
        try:
            store.delete(session_id)
        except SessionNotFound as exc:
            raise GatewayError(
                404, str(exc), type="not_found_error", code="session_not_found"
            ) from None
        return JSONResponse({"id": session_id, "deleted": True})

    # -- OpenAI API --------------------------------------------------------------------------

    def session_by_key(request: Request, session_id: str | None) -> Session:
        key = _bearer(request)
        if not key:
            raise GatewayError(
                401,
                "missing bearer token: use the session's api_key as the OpenAI api key",
                type="authentication_error",
                code="invalid_api_key",
            )
        try:
            session = store.by_api_key(key)
        except SessionNotFound:
            if session_id is not None:
                session_for(session_id)  # 404 for an unknown or deleted session
            raise GatewayError(
                401,
                "invalid api key for this gateway (sessions have their own keys)",
                type="authentication_error",
                code="invalid_api_key",
            ) from None
        if session_id is not None and session.id != session_id:
            raise GatewayError(
                401,
                "this api key belongs to another session",
                type="authentication_error",
                code="invalid_api_key",
            )
        return session

    async def chat(request: Request, session_id: str | None) -> Response:
        session = session_by_key(request, session_id)
        raw = await request.body()
        data = _json_object(raw)
        chat_request = _validate(ChatCompletionRequest, data)
        replay_key = hashlib.sha256(raw).hexdigest()
        if _is_retry(request):
            remembered = session.recall(replay_key)
            if remembered is not None:
                requests_total.labels("replayed").inc()
                if chat_request.stream:
                    return _sse_response(_replay_stream(json.loads(remembered), chat_request))
                return Response(remembered, media_type="application/json")
        call = service.prepare(session, chat_request, data["messages"])
        try:
            store.check_capacity(
                len(call.prompt_ids) + sum(s.max_new_tokens for s in call.sampling)
            )
        except StoreFull as exc:
            raise GatewayError(429, str(exc), type="rate_limit_error", code="store_full") from None

        async def commit(answer: Answer) -> None:  # async: no thread hop per request
            try:
                service.commit(session, answer, replay_key)
                requests_total.labels("recorded").inc()
            except SessionClosed:
                requests_total.labels("session_closed").inc()

        if chat_request.stream:
            answers: list[Answer] = []

            async def events() -> AsyncIterator[str]:
                # aclosing: if the client goes, the service's stream must run its cleanup
                # (engine abort) now, not whenever the garbage collector gets to it.
                async with contextlib.aclosing(service.stream(call, answers)) as stream:
                    async for event in stream:
                        yield event
                if answers:
                    await commit(answers[0])

            return _sse_response(events())

        try:
            body, answer = await _unless_disconnected(request, service.complete(call))
        except ClientGone:
            requests_total.labels("client_gone").inc()
            return Response(status_code=499)
        # Recorded only after the body went out: a turn the client never got is not kept.
        return Response(
            body, media_type="application/json", background=BackgroundTask(commit, answer)
        )

    @route("/sessions/{session_id}/v1/chat/completions", "POST")
    async def session_chat(request: Request, session_id: str) -> Response:
        return await chat(request, session_id)

    @route("/v1/chat/completions", "POST")
    async def bearer_chat(request: Request) -> Response:
        return await chat(request, None)

    def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": settings.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "corral",
                        "max_model_len": settings.max_context_tokens,
                    }
                ],
            }
        )

    @route("/v1/models", "GET")
    async def list_models(request: Request) -> JSONResponse:
        session_by_key(request, None)
        return models()

    @route("/sessions/{session_id}/v1/models", "GET")
    async def list_session_models(request: Request, session_id: str) -> JSONResponse:
        session_by_key(request, session_id)
        return models()

    # -- operations --------------------------------------------------------------------------

    @route("/health", "GET")
    async def health(request: Request) -> JSONResponse:
        engine_ok = await engine.health()
        return JSONResponse(
            {"status": "ok" if engine_ok else "degraded", "engine": engine_ok},
            status_code=200 if engine_ok else 503,
        )

    @route("/metrics", "GET")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(BodyLimit, max_bytes=settings.max_body_bytes)],
        exception_handlers={GatewayError: _gateway_error, EngineError: _engine_error},
    )


# -- helpers ---------------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; a 400 saying why otherwise."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return data


def _parse(model: type[M], raw: bytes) -> M:
    """Parse a JSON body into ``model``; a 400 naming the first bad field otherwise."""
    return _validate(model, _json_object(raw))


def _validate(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            message = f"unsupported field '{where}': the gateway cannot honour it"
            code = "unsupported_field"
        else:
            message = f"invalid field '{where}': {first['msg']}"
            code = "invalid_field"
        if len(exc.errors()) > 1:
            message += f" (and {len(exc.errors()) - 1} more problem(s))"
        raise bad_request(message, param=where, code=code) from None


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _is_retry(request: Request) -> bool:
    try:
        return int(request.headers.get(RETRY_HEADER, "0")) > 0
    except ValueError:
        return False


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse_response(events: AsyncIterator[str]) -> Response:
    return EventStream(events)


class EventStream(Response):
    """Server-sent events that stop the moment the client goes.

    Starlette's StreamingResponse on ASGI 2.4 servers only notices a disconnect when a send
    fails, and leaves the generator to the garbage collector; the engine would go on
    generating and the turn could be recorded. Here a watcher ends the stream on
    ``http.disconnect`` and the generator is always closed (its cleanup aborts the engine).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        # Not Response.__init__: it would declare a content-length for an empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send(
                    {"type": "http.response.body", "body": event.encode(), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watcher):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await streaming
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()


async def _replay_stream(
    body: dict[str, Any], request: ChatCompletionRequest
) -> AsyncIterator[str]:
    """A remembered answer as a stream: one delta per choice, then the finish reasons."""
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"]}
    base["model"] = body["model"]
    for choice in body["choices"]:
        message = dict(choice["message"])
        calls = message.pop("tool_calls", None)
        delta: dict[str, Any] = {**message}
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        yield (
            "data: "
            + json.dumps({**base, "choices": [{"index": choice["index"], "delta": delta}]})
            + "\n\n"
        )
        finish = {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}
        yield "data: " + json.dumps({**base, "choices": [finish]}) + "\n\n"
    if request.stream_options and request.stream_options.include_usage:
        yield "data: " + json.dumps({**base, "choices": [], "usage": body["usage"]}) + "\n\n"
    yield "data: [DONE]\n\n"


async def _reap_forever(store: SessionStore) -> None:
    while True:
        await asyncio.sleep(REAP_INTERVAL_S)
        store.reap()


class _StoreCollector:
    """Prometheus collector reading the store's stats at scrape time."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    def collect(self) -> Any:
        stats = self.store.stats()
        yield GaugeMetricFamily("corral_gateway_sessions", "Open sessions", value=stats.sessions)
        yield GaugeMetricFamily(
            "corral_gateway_held_tokens", "Tokens held by open sessions", value=stats.held_tokens
        )
        for name, value, doc in (
            ("turns", stats.turns_total, "Turns recorded"),
            ("merges", stats.merges_total, "Turns appended to a held trajectory"),
            ("forks", stats.forks_total, "Turns that started a new trajectory"),
            ("sessions_created", stats.created_total, "Sessions created"),
            ("sessions_expired", stats.expired_total, "Sessions expired"),
        ):
            yield CounterMetricFamily(f"corral_gateway_{name}", doc, value=value)
        reasons = CounterMetricFamily(
            "corral_gateway_merge_decisions", "Merge decisions by reason", labels=["reason"]
        )
        for reason, count in sorted(stats.decisions_by_reason.items()):
            reasons.add_metric([reason], count)
        yield reasons


class BodyLimit:
    """Rejects bodies over ``max_bytes`` with a 413 before the app reads them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _too_large(send, self.max_bytes)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise GatewayError(
                        413, f"the body is over {self.max_bytes} bytes", code="body_too_large"
                    )
            return message

        await self.app(scope, limited, send)


async def _too_large(send: Send, max_bytes: int) -> None:
    body = GatewayError(413, f"the body is over {max_bytes} bytes", code="body_too_large").body()
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": payload})
