"""The gateway's HTTP layer: routes, auth, body parsing and the choice of response. Logic lives
in the turn pipeline (:mod:`corral.gateway.pipeline`), the dialects
(:mod:`corral.gateway.dialects`) and the session store (:mod:`corral.gateway.sessions`).

``build_gateway_app`` serves the session-management API (docs/gateway.md, "API") and, per
session, three wire dialects over one pipeline: OpenAI Chat Completions, Anthropic Messages
and OpenAI Responses. Errors are :class:`~corral.gateway.errors.GatewayError` s, answered once,
here, in the shape of the dialect the request speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from corral.engines.client import EngineClient
from corral.gateway.client import FailBody, RewardBody, SessionCreated
from corral.gateway.dialects.anthropic_messages import AnthropicMessages
from corral.gateway.dialects.base import Dialect, RequestContext, validate
from corral.gateway.dialects.chat_completions import ChatCompletions
from corral.gateway.dialects.openai_responses import OpenAIResponses
from corral.gateway.errors import GatewayError, bad_request
from corral.gateway.journal import SessionJournal
from corral.gateway.json_body import json_object
from corral.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from corral.gateway.middleware import BodyLimit, RequestId, speaks_anthropic
from corral.gateway.options import SessionOptions
from corral.gateway.pipeline import Answer, TurnPipeline
from corral.gateway.sessions import (
    Session,
    SessionClosed,
    SessionNotFound,
    SessionStore,
    StoreFull,
)
from corral.gateway.settings import GatewaySettings
from corral.gateway.sse import EventStream
from corral.gateway.turns import (
    StreamedAnswer,
    TurnEvent,
    TurnRequest,
    TurnResult,
    compact_events,
    result_events,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# The Stainless-generated SDKs (OpenAI's and Anthropic's) send this on retries of a request.
RETRY_HEADER = "x-stainless-retry-count"
REAP_INTERVAL_S = 30.0
# GET /sessions: sessions a page holds unless ?limit= says otherwise, and the most it may ask.
LIST_LIMIT = 100
MAX_LIST_LIMIT = 1000


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def build_gateway_app(
    settings: GatewaySettings,
    engine: EngineClient,
    pipeline: TurnPipeline,
    *,
    store: SessionStore | None = None,
    startup_check: Callable[[], Awaitable[None]] | None = None,
    engine_states: Callable[[], list[dict[str, Any]] | None] | None = None,
) -> Starlette:
    """The gateway app. ``settings.admin_token`` None leaves session management open (local
    use only); otherwise every management route needs it as a bearer token.

    ``startup_check`` runs in the background once the app has started (it must not raise;
    :func:`corral.gateway.server.check_engine` logs whether the engine answers), so that a
    slow engine does not hold the gateway's start-up. ``engine_states``: each engine's state
    for ``/health``'s body (several engines behind a health monitor; None: not listed). The
    log: one line per failed request (:func:`_log_failure`), nothing per successful one."""
    store = store or SessionStore(
        max_sessions=settings.max_sessions,
        max_held_tokens=settings.max_held_tokens,
        default_ttl_s=settings.session_ttl_s,
        decode=lambda ids: str(pipeline.tokenizer.decode(list(ids), skip_special_tokens=False)),
        id_prefix=settings.session_id_prefix,
    )
    journal: SessionJournal | None = None
    if settings.journal_dir is not None:
        journal = SessionJournal(settings.journal_dir, sync=settings.journal_sync)
        restored = journal.restore_into(store)
    metrics = GatewayMetrics(store, journal)
    chat, messages, responses = ChatCompletions(), AnthropicMessages(), OpenAIResponses()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if journal is not None:  # said here: the CLI sets up logging after building the app
            log.info(
                "journal %s: %d live sessions rebuilt (%d turns)%s",
                journal.folder,
                restored.sessions,
                restored.turns,
                ", a torn last record dropped" if restored.torn else "",
            )
        reaper = asyncio.create_task(_reap_forever(store))
        syncer = None
        if journal is not None and journal.sync == "interval":
            syncer = asyncio.create_task(journal.sync_every())
        checking: asyncio.Future[None] | None = None
        if startup_check is not None:
            checking = asyncio.ensure_future(startup_check())
        try:
            yield
        finally:
            reaper.cancel()
            if syncer is not None:
                syncer.cancel()
            if checking is not None:
                checking.cancel()
            if journal is not None:
                journal.close()
            await engine.aclose()

    # Plain Starlette, not FastAPI: every handler parses its own body (to answer in its
    # dialect's error shape), so FastAPI's extra layers would only add cost on the hot path.
    routes: list[Route] = []

    def route(
        path: str, method: str, dialect: Dialect | None = None
    ) -> Callable[[Callable[..., Awaitable[Response]]], None]:
        dialect_name = dialect.name if dialect is not None else "none"

        def register(handler: Callable[..., Awaitable[Response]]) -> None:
            async def endpoint(request: Request) -> Response:
                start = time.perf_counter()
                try:
                    response = await handler(request, **request.path_params)
                except GatewayError as exc:
                    response = _error_response(exc, dialect, request)
                except Exception as exc:  # a bug: answered 500 in the dialect's shape
                    response = _error_response(_unexpected(exc), dialect, request)
                    log.debug("the traceback of the 500 above", exc_info=exc)
                if not isinstance(response, EventStream):
                    metrics.request(
                        path, dialect_name, response.status_code, time.perf_counter() - start
                    )
                else:
                    metrics.request(path, dialect_name, 200, None)
                return response

            routes.append(Route(path, endpoint, methods=[method]))

        return register

    def require_admin(request: Request) -> None:
        if settings.admin_token is None:
            return
        if not _same_secret(_bearer(request), settings.admin_token):
            raise GatewayError(
                "authentication",
                "this route needs the gateway's admin token as a bearer token",
                code="invalid_api_key",
            )

    def session_for(session_id: str) -> Session:
        try:
            return store.get(session_id)
        except SessionNotFound as exc:
            raise GatewayError("not_found", str(exc), code="session_not_found") from None

    async def durable() -> None:
        """Under ``--journal-sync always``: return once the journal holds what was just done
        on disk (called before a change's answer goes out)."""
        if journal is not None:
            await journal.durable()

    # -- session management ----------------------------------------------------------------

    @route("/sessions", "POST")
    async def create_session(request: Request) -> JSONResponse:
        require_admin(request)
        raw = await request.body()
        options = (
            validate(SessionOptions, json_object(raw, settings.max_json_depth))
            if raw.strip()
            else SessionOptions()
        )
        try:
            session = store.create(options)
        except StoreFull as exc:
            raise GatewayError("rate_limit", str(exc), code="store_full") from None
        root = str(request.base_url).rstrip("/") + f"/sessions/{session.id}"
        created = SessionCreated(
            id=session.id, base_url=root + "/v1", anthropic_base_url=root, api_key=session.api_key
        )
        await durable()
        return JSONResponse(created.model_dump(), status_code=201)

    @route("/sessions", "GET")
    async def list_sessions(request: Request) -> JSONResponse:
        require_admin(request)
        limit = _query_int(request, "limit", default=LIST_LIMIT, low=1, high=MAX_LIST_LIMIT)
        after = request.query_params.get("after") or None
        try:
            page = store.page(limit=limit, after=after)
        except SessionNotFound as exc:
            raise GatewayError("not_found", str(exc), code="session_not_found") from None
        return JSONResponse(page.model_dump())

    @route("/sessions/{session_id}", "GET")
    async def get_session(request: Request, session_id: str) -> JSONResponse:
        require_admin(request)
        return JSONResponse(session_for(session_id).view())

    @route("/sessions/{session_id}/reward", "POST")
    async def set_reward(request: Request, session_id: str) -> JSONResponse:
        require_admin(request)
        body = validate(RewardBody, json_object(await request.body(), settings.max_json_depth))
        session = session_for(session_id)
        try:
            session.set_reward(body.reward)
        except ValueError as exc:
            raise bad_request(str(exc), param="reward") from None
        await durable()
        return JSONResponse({"id": session_id, "reward": session.reward})

    @route("/sessions/{session_id}/fail", "POST")
    async def fail_session(request: Request, session_id: str) -> JSONResponse:
        require_admin(request)
        body = validate(FailBody, json_object(await request.body(), settings.max_json_depth))
        session_for(session_id).mark_failed(body.reason)
        await durable()
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
            raise GatewayError("not_found", str(exc), code="session_not_found") from None
        await durable()
        return JSONResponse({"id": session_id, "deleted": True})

    # -- the dialects ------------------------------------------------------------------------

    def session_by_key(request: Request, session_id: str | None) -> Session:
        key = _session_key(request)
        if not key:
            raise GatewayError(
                "authentication",
                "missing API key: use the session's api_key (as a bearer token or x-api-key)",
                code="invalid_api_key",
            )
        try:
            session = store.by_api_key(key)
        except SessionNotFound:
            if session_id is not None:
                session_for(session_id)  # 404 for an unknown or deleted session
            raise GatewayError(
                "authentication",
                "invalid api key for this gateway (sessions have their own keys)",
                code="invalid_api_key",
            ) from None
        if session_id is not None and session.id != session_id:
            raise GatewayError(
                "authentication",
                "this api key belongs to another session",
                code="invalid_api_key",
            )
        return session

    async def read_turn(
        request: Request,
        session_id: str | None,
        parse: Callable[[dict[str, Any], RequestContext], TurnRequest],
    ) -> tuple[RequestContext, TurnRequest, bytes]:
        session = session_by_key(request, session_id)
        _check_json_content_type(request)
        raw = await request.body()
        data = json_object(raw, settings.max_json_depth)
        ctx = RequestContext(session=session, headers=request.headers, query=request.query_params)
        return ctx, parse(data, ctx), raw

    async def turn(request: Request, session_id: str | None, dialect: Dialect) -> Response:
        ctx, turn_request, raw = await read_turn(request, session_id, dialect.parse)
        session = ctx.session
        replay_key = dialect.name + ":" + hashlib.sha256(raw).hexdigest()
        if _is_retry(request):
            remembered = session.recall(replay_key)
            if isinstance(remembered, TurnResult | StreamedAnswer):
                metrics.outcomes.labels("replayed").inc()
                return answer_with(dialect, turn_request, ctx, remembered)
        call = await pipeline.prepare_async(session, turn_request)
        try:
            store.check_capacity(
                len(call.prompt_ids) + sum(s.max_new_tokens for s in call.sampling)
            )
        except StoreFull as exc:
            raise GatewayError("rate_limit", str(exc), code="store_full") from None

        async def commit(
            answer: Answer, streamed: list[TurnEvent] | None = None
        ) -> None:  # async: no thread hop per request
            try:
                with journal.together() if journal is not None else contextlib.nullcontext():
                    pipeline.commit(session, answer)
                    # What a retry of this request gets: a stream replays as it went out.
                    session.remember(
                        replay_key,
                        answer.result
                        if streamed is None
                        else StreamedAnswer(answer.result, tuple(compact_events(streamed))),
                    )
                metrics.outcomes.labels("recorded").inc()
                metrics.turn(dialect.name, answer.result.usage)
            except SessionClosed:
                metrics.outcomes.labels("session_closed").inc()
            await durable()

        if turn_request.stream:
            answers: list[Answer] = []
            stream = pipeline.stream(call, answers)
            try:
                # The headers wait for the engine's first output: an engine that fails before
                # it is an error status the client's retry logic understands, not a 200.
                head = await _unless_disconnected(request, _first_batches(stream, 2))
            except ClientGone:
                await stream.aclose()
                metrics.outcomes.labels("client_gone").inc()
                return Response(status_code=499)
            except BaseException:
                await stream.aclose()
                raise

            async def batches() -> AsyncIterator[Sequence[TurnEvent]]:
                # aclosing: if the client goes, the pipeline's stream must run its cleanup
                # (engine abort) now, not whenever the garbage collector gets to it.
                sent: list[TurnEvent] = []
                async with contextlib.aclosing(stream):
                    try:
                        async for batch in _after(head, stream):
                            sent.extend(batch)
                            if answers:
                                # Recorded before the closing frames go out: a client that
                                # retries the moment it has them must find the answer to replay.
                                await commit(answers.pop(), sent)
                            yield batch
                    except GatewayError as exc:  # mid-stream: the dialect frames it as an event
                        _log_failure(exc, request)
                        raise

            async def events() -> AsyncIterator[str]:
                async with contextlib.aclosing(dialect.frame(batches(), turn_request, ctx)) as f:
                    async for event in f:
                        yield event

            return EventStream(events())

        try:
            answer = await _unless_disconnected(request, pipeline.complete(call))
        except ClientGone:
            metrics.outcomes.labels("client_gone").inc()
            return Response(status_code=499)
        body = dialect.render(answer.result, turn_request, ctx)
        # Recorded before the body goes out (a client that retries the moment it has it must
        # find the answer to replay); a client gone before the answer was ready got nothing
        # recorded (above).
        await commit(answer)
        return Response(body, media_type="application/json")

    def answer_with(
        dialect: Dialect,
        turn_request: TurnRequest,
        ctx: RequestContext,
        remembered: TurnResult | StreamedAnswer,
    ) -> Response:
        """A remembered answer, answered again as the request asks (plain or streamed; a
        streamed one in the order it first went out)."""
        result = remembered.result if isinstance(remembered, StreamedAnswer) else remembered
        if not turn_request.stream:
            return Response(
                dialect.render(result, turn_request, ctx), media_type="application/json"
            )
        events = (
            remembered.events if isinstance(remembered, StreamedAnswer) else result_events(result)
        )

        async def batches() -> AsyncIterator[Sequence[TurnEvent]]:
            for event in events:
                yield [event]

        return EventStream(dialect.frame(batches(), turn_request, ctx))

    def turn_routes(suffix: str, dialect: Dialect) -> None:
        @route("/sessions/{session_id}/v1" + suffix, "POST", dialect)
        async def in_session(request: Request, session_id: str) -> Response:
            return await turn(request, session_id, dialect)

        @route("/v1" + suffix, "POST", dialect)
        async def by_key(request: Request) -> Response:
            return await turn(request, None, dialect)

    turn_routes("/chat/completions", chat)
    turn_routes("/messages", messages)
    turn_routes("/responses", responses)

    async def count_tokens(request: Request, session_id: str | None) -> Response:
        ctx, turn_request, _ = await read_turn(request, session_id, messages.parse_count_tokens)
        prepared = await asyncio.to_thread(pipeline.render, ctx.session, turn_request)
        return JSONResponse({"input_tokens": len(prepared.prompt_ids)})

    @route("/sessions/{session_id}/v1/messages/count_tokens", "POST", messages)
    async def session_count_tokens(request: Request, session_id: str) -> Response:
        return await count_tokens(request, session_id)

    @route("/v1/messages/count_tokens", "POST", messages)
    async def bearer_count_tokens(request: Request) -> Response:
        return await count_tokens(request, None)

    def model_card() -> dict[str, Any]:
        return {
            "id": settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "corral",
            "max_model_len": settings.max_context_tokens,
            # vLLM's and SGLang's model cards name the weights the model was served from.
            "root": settings.model_name,
            "parent": None,
            # Anthropic's model object, for clients of the Messages API.
            "type": "model",
            "display_name": settings.model_name,
            "created_at": "1970-01-01T00:00:00Z",
        }

    def models_list() -> JSONResponse:
        card = model_card()
        return JSONResponse(
            {
                "object": "list",
                "data": [card],
                "has_more": False,
                "first_id": card["id"],
                "last_id": card["id"],
            }
        )

    def one_model(model_id: str) -> JSONResponse:
        if model_id != settings.model_name:
            raise GatewayError(
                "not_found",
                f"the model '{model_id}' does not exist here; this gateway serves "
                f"'{settings.model_name}'",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(model_card())

    @route("/v1/models", "GET")
    async def list_models(request: Request) -> JSONResponse:
        session_by_key(request, None)
        return models_list()

    @route("/sessions/{session_id}/v1/models", "GET")
    async def list_session_models(request: Request, session_id: str) -> JSONResponse:
        session_by_key(request, session_id)
        return models_list()

    @route("/v1/models/{model_id:path}", "GET")
    async def get_model(request: Request, model_id: str) -> JSONResponse:
        session_by_key(request, None)
        return one_model(model_id)

    @route("/sessions/{session_id}/v1/models/{model_id:path}", "GET")
    async def get_session_model(request: Request, session_id: str, model_id: str) -> JSONResponse:
        session_by_key(request, session_id)
        return one_model(model_id)

    # -- operations --------------------------------------------------------------------------

    @route("/health", "GET")
    async def health(request: Request) -> JSONResponse:
        engine_ok = await engine.health()
        body: dict[str, Any] = {"status": "ok" if engine_ok else "degraded", "engine": engine_ok}
        states = engine_states() if engine_states is not None else None
        if states is not None:
            body["engines"] = states
        return JSONResponse(body, status_code=200 if engine_ok else 503)

    @route("/metrics", "GET")
    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: Exception) -> Response:
        # Starlette's own answers (unknown route, wrong method) in the dialect's JSON shape.
        assert isinstance(exc, HTTPException)
        kind_message = {
            404: f"no route {request.url.path}",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        error = GatewayError.for_status(exc.status_code, kind_message)
        metrics.request("unmatched", "none", error.status, None)
        return _error_response(error, None, request)

    async def gateway_error(request: Request, exc: Exception) -> Response:
        # A GatewayError raised outside a handler (the body limit, mid-read).
        assert isinstance(exc, GatewayError)
        return _error_response(exc, None, request)

    return Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[
            Middleware(RequestId),
            Middleware(BodyLimit, max_bytes=settings.max_body_bytes),
        ],
        exception_handlers={HTTPException: http_error, GatewayError: gateway_error},
    )


# -- helpers ---------------------------------------------------------------------------------


def _error_response(error: GatewayError, dialect: Dialect | None, request: Request) -> Response:
    """The answer to ``error``, in the dialect's shape; logs the request's one line."""
    _log_failure(error, request)
    if dialect is not None:
        body = dialect.error_body(error)
    elif speaks_anthropic(request.scope):
        body = error.anthropic_body()
    else:
        body = error.openai_body()
    return JSONResponse(body, status_code=error.status)


def _log_failure(error: GatewayError, request: Request) -> None:
    """One line for a failed request: method, path, status, kind, message (with the error's
    log-only detail, e.g. the engine's own words) and request id. Levels: engine failures
    (502/503/504) and a full store (429) WARNING, the gateway's own failures (500) ERROR,
    other client errors (4xx) INFO."""
    status = error.status
    if status == 500:
        level = logging.ERROR
    elif status >= 500 or status == 429:
        level = logging.WARNING
    else:
        level = logging.INFO
    if not log.isEnabledFor(level):
        return
    said = error.message if error.detail is None else f"{error.message} ({error.detail})"
    request_id = request.scope.get("state", {}).get("request_id", "-")
    log.log(
        level,
        "%s %s %d %s: %s request_id=%s",
        request.method,
        request.url.path,
        status,
        error.kind,
        said,
        request_id,
    )


def _unexpected(exc: Exception) -> GatewayError:
    """The 500 for an exception no layer mapped (a bug); the log line names it."""
    return GatewayError(
        "internal",
        "the gateway failed to answer this request",
        detail=f"{type(exc).__name__}: {exc}",
    )


def _query_int(request: Request, name: str, *, default: int, low: int, high: int) -> int:
    """The integer query parameter ``name`` (``default`` when absent); a 400 naming it for
    anything but an integer in ``[low, high]``."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise bad_request(f"{name} must be an integer from {low} to {high}", param=name)
    return value


def _same_secret(given: str, expected: str) -> bool:
    # compare_digest refuses non-ASCII str: compare bytes, so such a token is a 401, not a 500.
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _session_key(request: Request) -> str:
    """The session key: a bearer token (OpenAI's clients, Claude Code's auth token) or
    Anthropic's ``x-api-key``."""
    return _bearer(request) or request.headers.get("x-api-key", "").strip()


def _check_json_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type")
    if content_type is None:
        return  # a client that names no type is taken at its word that it sends JSON
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise bad_request(
            f"the body must be application/json, not {media or 'an empty content type'}",
            code="invalid_content_type",
        )


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


async def _after(head: Sequence[T], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """``head``'s items, then ``rest``'s."""
    for item in head:
        yield item
    async for item in rest:
        yield item


async def _first_batches(
    stream: AsyncIterator[Sequence[TurnEvent]], n: int
) -> list[Sequence[TurnEvent]]:
    """Up to the first ``n`` batches of ``stream`` (fewer when it ends sooner)."""
    out: list[Sequence[TurnEvent]] = []
    async for batch in stream:
        out.append(batch)
        if len(out) == n:
            break
    return out


async def _reap_forever(store: SessionStore) -> None:
    while True:
        await asyncio.sleep(REAP_INTERVAL_S)
        store.reap()
