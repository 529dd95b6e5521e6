"""HTTP face of ``LocalEngine``: SGLang's native API (``/generate``, ``/abort_request``, ...).

Thin on purpose: parsing, status codes and SSE framing live here; all behaviour lives in
``LocalEngine``. Like the engine, this is not SGLang; it speaks the subset corral uses.

Errors: a body that is not JSON, does not match the protocol models (unknown fields included)
or that the engine refuses gets a 400 ``{"error": {"message", "type": "invalid_request_error"}}``.
A client that disconnects aborts its request (streaming: at once; non-streaming: noticed within
about a second, as SGLang does by polling the connection).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from corral.engines.local.engine import InvalidRequestError, LocalEngine
from corral.engines.protocol import (
    AbortRequest,
    GenerateRequest,
    GenerateResponse,
    UpdateWeightsFromDiskRequest,
)

__all__ = ["build_engine_app", "run_engine"]

M = TypeVar("M", bound=BaseModel)

# How often a non-streaming /generate checks whether its client is still connected.
_DISCONNECT_POLL_S = 1.0


def _error(message: str, status: int = 400, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class _BadRequest(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


async def _parse(request: Request, model: type[M]) -> M:
    """The body as ``model``, or ``_BadRequest`` saying what is wrong with it."""
    body = await request.body()
    try:
        data = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _BadRequest(f"body is not valid JSON: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        details = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise _BadRequest(f"invalid {model.__name__}: {details}") from exc


def _chunk_json(resp: GenerateResponse) -> dict[str, Any]:
    """SGLang's JSON: ``finish_reason`` carries only the keys that apply to its type."""
    data = resp.model_dump(mode="json")
    reason = data["meta_info"].get("finish_reason")
    if reason is not None:
        data["meta_info"]["finish_reason"] = {k: v for k, v in reason.items() if v is not None}
    return data


def build_engine_app(engine: LocalEngine) -> FastAPI:
    """A FastAPI app serving ``engine``; the app's lifespan starts and stops the engine."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="corral local engine (not SGLang)", lifespan=lifespan)

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
        req = await _parse(request, GenerateRequest)
        if req.stream:
            chunks = engine.stream(req)  # validates and enqueues now: errors are still a 400
            return StreamingResponse(_sse(chunks), media_type="text/event-stream")
        return JSONResponse(_chunk_json(await _until_done_or_gone(engine, req, request)))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
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
    async def get_model_info() -> dict[str, Any]:
        return engine.model_info().model_dump(mode="json")

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return engine.server_info()

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        # There is no prefix cache to flush; KV lives only as long as its request.
        return Response("Cache flushed.\n", status_code=200, media_type="text/plain")

    return app


async def _sse(chunks: AsyncIterator[GenerateResponse]) -> AsyncIterator[bytes]:
    """SGLang's SSE framing. If the client goes away, Starlette cancels this generator and the
    engine's iterator aborts the request as it unwinds."""
    try:
        async for chunk in chunks:
            yield b"data: " + json.dumps(_chunk_json(chunk)).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
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
) -> None:
    """Load ``model_path`` and serve it until interrupted (blocking; used by ``corral engine``)."""
    import uvicorn

    engine = LocalEngine(model_path, device=device, max_batch_size=max_batch_size)
    from corral.serving import KEEP_ALIVE_S

    uvicorn.run(
        build_engine_app(engine),
        host=host,
        port=port,
        log_level="info",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
