"""HTTP face of ``LocalEngine``: SGLang's native API (``/generate``, ``/abort_request``, ...).

Thin on purpose: parsing, status codes and SSE framing live here; all behaviour lives in
``LocalEngine``. Like the engine, this is not SGLang; it speaks the subset corral uses, so that
it drops in as a worker behind SGLang's routers (sglang-router, smg):

- ``/generate`` takes SGLang's whole ``GenerateReqInput`` (what the routers forward), see
  :func:`corral.engines.protocol.parse_generate_input` for what is honoured, ignored, refused.
- smg's worker registration probes ``/v1/models`` (``owned_by: "sglang"`` marks an SGLang
  worker), ``/server_info`` and ``/model_info`` (falling back to ``/get_server_info`` and
  ``/get_model_info``), then health-checks ``/health``. There is deliberately no
  ``/version``: smg takes a worker answering it for vLLM.
- ``/metrics`` (Prometheus text) counts the requests this engine served, so a test or an
  operator sees from the engine's side where a router sent what.

Auth: built with a ``token``, every route but ``/health`` wants ``Authorization: Bearer
<token>`` (SGLang's ``--api-key`` header; ``/health`` stays open for liveness probes), else a
401 ``{"error": {"message", "type": "authentication_error"}}`` before the route runs.
Without one, :func:`run_engine` listens on loopback only.

Errors: a body that is not JSON, does not match the protocol models (unknown fields included)
or that the engine refuses gets a 400 ``{"error": {"message", "type": "invalid_request_error"}}``.
A client that disconnects aborts its request (streaming: at once; non-streaming: noticed within
about a second, as SGLang does by polling the connection).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

import corral
from corral.bearer import BearerGate
from corral.engines.local.engine import InvalidRequestError, LocalEngine
from corral.engines.local.settings import is_loopback
from corral.engines.protocol import (
    AbortRequest,
    GenerateRequest,
    GenerateResponse,
    SamplingParams,
    UnsupportedFieldsError,
    UpdateWeightsFromDiskRequest,
    parse_generate_input,
)
from corral.validation import validation_message

__all__ = ["build_engine_app", "run_engine"]

M = TypeVar("M", bound=BaseModel)

# How often a non-streaming /generate checks whether its client is still connected.
_DISCONNECT_POLL_S = 1.0
# How long /health_generate waits for its one token (SGLang's SGLANG_HEALTH_CHECK_TIMEOUT).
_HEALTH_GENERATE_S = 20.0


def _error(message: str, status: int = 400, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class _BadRequest(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


async def _json(request: Request) -> Any:
    body = await request.body()
    try:
        return json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _BadRequest(f"body is not valid JSON: {exc}") from exc


def _invalid(model: type[BaseModel], exc: ValidationError) -> _BadRequest:
    return _BadRequest(f"invalid {model.__name__}: {validation_message(exc, root='body')}")


async def _parse(request: Request, model: type[M]) -> M:
    """The body as ``model``, or ``_BadRequest`` saying what is wrong with it."""
    data = await _json(request)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(model, exc) from exc


async def _parse_generate(request: Request) -> GenerateRequest:
    """The body as SGLang's ``GenerateReqInput`` (``parse_generate_input``), or
    ``_BadRequest`` naming what is malformed or what the engine cannot do."""
    data = await _json(request)
    try:
        return parse_generate_input(data)
    except UnsupportedFieldsError as exc:
        raise _BadRequest(f"invalid GenerateRequest: {exc}") from exc
    except ValidationError as exc:
        raise _invalid(GenerateRequest, exc) from exc


# The one route a token does not guard: liveness probes (process launchers, routers) carry none.
_OPEN_PATHS = frozenset({"/health"})
_REFUSAL = {
    "error": {
        "message": "this engine needs its token: Authorization: Bearer <token>",
        "type": "authentication_error",
    }
}


@dataclass
class EngineCounters:
    """What this engine served since it started, as ``/metrics`` reports it.

    ``generate_requests`` counts every ``/generate`` answered with a 200 (a stream when it
    starts, a plain request when it finishes; a 400 is not counted, nor ``/health_generate``);
    the token counts are added when a request finishes (aborted ones included, with what they
    had produced).
    """

    generate_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    abort_requests: int = 0

    def finished(self, resp: GenerateResponse) -> None:
        self.prompt_tokens += resp.meta_info.prompt_tokens
        self.completion_tokens += resp.meta_info.completion_tokens

    def prometheus(self) -> str:
        rows = [
            ("generate_requests", "/generate requests accepted"),
            ("prompt_tokens", "prompt tokens of finished /generate requests"),
            ("completion_tokens", "tokens generated by finished /generate requests"),
            ("abort_requests", "/abort_request calls"),
        ]
        lines = []
        for name, help_text in rows:
            metric = f"corral_engine_{name}_total"
            lines += [
                f"# HELP {metric} {help_text}",
                f"# TYPE {metric} counter",
                f"{metric} {getattr(self, name)}",
            ]
        return "\n".join(lines) + "\n"


def _chunk_json(resp: GenerateResponse) -> dict[str, Any]:
    """SGLang's JSON: ``finish_reason`` carries only the keys that apply to its type."""
    data = resp.model_dump(mode="json")
    reason = data["meta_info"].get("finish_reason")
    if reason is not None:
        data["meta_info"]["finish_reason"] = {k: v for k, v in reason.items() if v is not None}
    return data


def build_engine_app(engine: LocalEngine, *, token: str | None = None) -> FastAPI:
    """A FastAPI app serving ``engine``; the app's lifespan starts and stops the engine.
    ``token``: every route but ``/health`` answers only to it as a bearer (module docstring);
    None: open to whoever reaches the port. ``ValueError`` for an empty token."""
    if token is not None and not token:
        raise ValueError("an empty engine token would guard nothing")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="corral local engine (not SGLang)", lifespan=lifespan)
    if token is not None:
        app.add_middleware(BearerGate, token=token, open_paths=_OPEN_PATHS, refusal=_REFUSAL)
    counters = EngineCounters()
    app.state.counters = counters
    created = int(time.time())

    @app.exception_handler(_BadRequest)
    async def _bad_request(_: Request, exc: _BadRequest) -> JSONResponse:
        return _error(exc.message)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(str(exc.errors()))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req = await _parse_generate(request)
        if req.stream:
            chunks = engine.stream(req)  # validates and enqueues now: errors are still a 400
            counters.generate_requests += 1
            return StreamingResponse(_sse(chunks, counters), media_type="text/event-stream")
        resp = await _until_done_or_gone(engine, req, request)  # a refusal raises: a 400
        counters.generate_requests += 1
        counters.finished(resp)
        return JSONResponse(_chunk_json(resp))

    @app.get("/health_generate")
    async def health_generate() -> Response:
        # SGLang's: healthy only if one token can be generated now.
        probe = GenerateRequest(
            input_ids=[0],
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
            return_logprob=False,
        )
        try:
            await asyncio.wait_for(engine.generate(probe), timeout=_HEALTH_GENERATE_S)
        except (TimeoutError, InvalidRequestError, RuntimeError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        counters.abort_requests += 1
        req = await _parse(request, AbortRequest)
        if req.abort_all:
            engine.abort_all()
        elif req.rid:
            engine.abort(req.rid)
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        req = await _parse(request, UpdateWeightsFromDiskRequest)
        if req.load_format not in (None, "auto"):
            raise _BadRequest(f"load_format {req.load_format!r} is not supported (only 'auto')")
        result = await engine.update_weights_from_disk(req.model_path, req.weight_version)
        return JSONResponse(
            result.model_dump(mode="json"), status_code=200 if result.success else 400
        )

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.health() else 503)

    @app.get("/get_model_info")
    @app.get("/model_info")  # SGLang's newer name; smg tries it first
    async def get_model_info() -> dict[str, Any]:
        return engine.model_info().model_dump(mode="json")

    @app.get("/get_server_info")
    @app.get("/server_info")  # SGLang's newer name; smg's worker detection probes it
    async def get_server_info() -> dict[str, Any]:
        info = engine.server_info()
        # The keys smg reads (it labels the worker with them), as SGLang names them.
        return {
            **info,
            "served_model_name": engine.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "max_running_requests": info["max_batch_size"],
            "is_embedding": False,
            "version": f"corral-{corral.__version__}",
        }

    @app.get("/v1/models")
    async def v1_models() -> dict[str, Any]:
        # Only what smg reads: it takes owned_by "sglang" for a worker speaking SGLang's
        # native API (true of this engine), id as the served model name, root as its path.
        model: dict[str, Any] = {
            "id": engine.model_path,
            "object": "model",
            "created": created,
            "owned_by": "sglang",
            "root": engine.model_path,
        }
        if engine.context_length is not None:
            model["max_model_len"] = engine.context_length
        return {"object": "list", "data": [model]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(counters.prometheus(), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        # There is no prefix cache to flush; KV lives only as long as its request.
        return Response("Cache flushed.\n", status_code=200, media_type="text/plain")

    return app


async def _sse(
    chunks: AsyncIterator[GenerateResponse], counters: EngineCounters
) -> AsyncIterator[bytes]:
    """SGLang's SSE framing. If the client goes away, Starlette cancels this generator and the
    engine's iterator aborts the request as it unwinds."""
    last: GenerateResponse | None = None
    try:
        async for chunk in chunks:
            last = chunk
            yield b"data: " + json.dumps(_chunk_json(chunk)).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        if last is not None:
            counters.finished(last)
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


async def _until_done_or_gone(
    engine: LocalEngine, req: GenerateRequest, request: Request
) -> GenerateResponse:
    """Run ``req``; if the client disconnects first, abort it (it then finishes as ``abort``)."""
    if req.rid is None:
        req = req.model_copy(update={"rid": uuid.uuid4().hex})
    rid = req.rid
    assert rid is not None
    task = asyncio.ensure_future(engine.generate(req))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                engine.abort(rid, "client went away")
    finally:
        if not task.done():
            task.cancel()


def run_engine(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    device: str = "cpu",
    max_batch_size: int = 64,
    token: str | None = None,
) -> None:
    """Load ``model_path`` and serve it until SIGINT / SIGTERM (blocking; used by ``corral
    engine``): :func:`corral.serving.serve_forever`, so a SIGTERM is a clean exit and a port
    that cannot be bound raises its ``BindError``. ``token``: what every route but
    ``/health`` requires; without one, a ``host`` beyond loopback is a ``ValueError`` (raised
    before the model loads): anyone reaching the port could abort requests and swap the
    weights."""
    from corral.serving import serve_forever

    if token is None and not is_loopback(host):
        raise ValueError(f"the engine listens on {host} only with a token (or on 127.0.0.1)")
    engine = LocalEngine(model_path, device=device, max_batch_size=max_batch_size)
    serve_forever(build_engine_app(engine, token=token), host=host, port=port)
