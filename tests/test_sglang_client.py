"""SGLangClient against real HTTP servers on 127.0.0.1.

The FastAPI apps below are protocol stand-ins written for this file: they speak SGLang's
native API (both streaming modes, and the older mixed forms) so that the client's parsing,
delta logic, error paths and retry policy can be driven on purpose, which a real engine
will not do on demand. The real local engine is tested in its own files; the last test
here runs the client against it when it is available.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from corral.engines.errors import (
    EngineError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
)
from corral.engines.protocol import GenerateRequest, SamplingParams
from corral.engines.sglang import EngineStatusError, SGLangClient
from corral.engines.stream import StreamDelta
from tests.servers import free_port, serve

PROMPT = [5, 6, 7]


def _tokens(input_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """The stand-in's deterministic 'generation': ids after the last prompt id."""
    ids = [(input_ids[-1] + i + 1) % 1000 for i in range(n)]
    return ids, [-(i + 1) / 4 for i in range(n)]


def _boundaries(n: int) -> list[int]:
    """Token counts after each chunk: 1, 3, 4, 5, ... n (the 1->3 step is a coalesced
    two-token chunk, as SGLang sends when several outputs queued up)."""
    return sorted({k for k in [1, 3, *range(4, n + 1)] if k <= n} | {n})


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def sglang_app(mode: str = "cumulative", *, chunk_delay: float = 0.0) -> FastAPI:
    """A protocol stand-in for SGLang's native API (not an engine; see the module docstring).

    ``mode`` picks the streaming form: ``cumulative`` (SGLang's default), ``incremental``
    (``--incremental-streaming-output``), ``mixed`` (older ``--stream-output``: delta
    output_ids, cumulative logprobs), ``logprobs_only`` (no output_ids at all). Requests
    are recorded on ``app.state`` for the tests to inspect.
    """
    app = FastAPI()
    app.state.bodies = []
    app.state.stream_closed = threading.Event()

    def meta(
        body: dict[str, Any], k: int, n: int, lps: list[list[Any]], ids: list[int]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": body.get("rid") or "rid-1",
            "finish_reason": {"type": "length", "length": n} if k == n else None,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": k,
            "cached_tokens": 0,
            "weight_version": "v1",
        }
        if body.get("return_logprob"):
            out["output_token_logprobs"] = lps
            if body.get("top_logprobs_num"):
                out["output_top_logprobs"] = [
                    [[lp, i, None], [lp - 1, i + 1, None]] for lp, i, _ in lps
                ]
        return out

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        app.state.bodies.append(body)
        n = body.get("sampling_params", {}).get("max_new_tokens", 128)
        ids, lps = _tokens(body["input_ids"], n)
        triples = [[lp, i, None] for lp, i in zip(lps, ids, strict=True)]
        text = "".join(f"<{i}>" for i in ids)
        if not body.get("stream"):
            return JSONResponse(
                {"text": text, "output_ids": ids, "meta_info": meta(body, n, n, triples, ids)}
            )

        async def chunks() -> AsyncIterator[bytes]:
            try:
                prev = 0
                for k in _boundaries(n):
                    if chunk_delay:
                        await asyncio.sleep(chunk_delay)
                    new = slice(prev, k)
                    upto = slice(0, k)
                    if mode == "cumulative":
                        chunk = {
                            "text": "".join(f"<{i}>" for i in ids[upto]),
                            "output_ids": ids[upto],
                            "meta_info": meta(body, k, n, triples[upto], ids[upto]),
                        }
                    elif mode == "incremental":
                        chunk = {
                            "text": "".join(f"<{i}>" for i in ids[new]),
                            "output_ids": ids[new],
                            "meta_info": meta(body, k, n, triples[new], ids[new]),
                        }
                    elif mode == "mixed":
                        chunk = {
                            "text": "".join(f"<{i}>" for i in ids[upto]),
                            "output_ids": ids[new],
                            "meta_info": meta(body, k, n, triples[upto], ids[upto]),
                        }
                    else:  # logprobs_only
                        chunk = {
                            "text": "".join(f"<{i}>" for i in ids[upto]),
                            "meta_info": meta(body, k, n, triples[upto], ids[upto]),
                        }
                    prev = k
                    yield _sse(chunk)
                yield b"data: [DONE]\n\n"
            finally:
                # Runs when the client disconnects too: Starlette cancels the generator.
                app.state.stream_closed.set()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        app.state.bodies.append(await request.json())
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": "/models/tiny",
            "tokenizer_path": "/models/tiny",
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "v1",
        }

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request) -> Response:
        body = await request.json()
        app.state.bodies.append(body)
        if "missing" in body["model_path"]:
            # SGLang answers a failed load with 400 and success false.
            return JSONResponse(
                {
                    "success": False,
                    "message": f"Failed to get weights iterator: {body['model_path']} not found",
                    "num_paused_requests": None,
                },
                status_code=400,
            )
        message = "Succeeded to update model weights."
        if body.get("weight_version"):
            message += f" Weight version updated to {body['weight_version']}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return PlainTextResponse("Cache flushed.\n")

    return app


def broken_app(*, hang_s: float = 1.0) -> FastAPI:
    """A protocol stand-in that misbehaves on purpose, for the client's error paths.

    ``/generate`` picks its misbehaviour from the request's ``rid``; every request is
    counted per rid (``app.state.hits``) so that tests can check what was retried.
    ``/get_model_info`` hangs on its first call only; ``/health`` answers 503.
    """
    app = FastAPI()
    app.state.hits = Counter()

    def good_chunk(k: int, finished: bool) -> dict[str, Any]:
        ids, lps = _tokens(PROMPT, k)
        return {
            "text": "",
            "output_ids": ids,
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": 2} if finished else None,
                "prompt_tokens": 3,
                "completion_tokens": k,
                "output_token_logprobs": [[lp, i, None] for lp, i in zip(lps, ids, strict=True)],
            },
        }

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        rid = body.get("rid", "")
        app.state.hits[rid] += 1
        if rid == "garbage":
            return PlainTextResponse("<html>this is not json</html>")
        if rid == "error500":
            return JSONResponse({"error": {"message": "CUDA out of memory"}}, status_code=500)
        if rid == "error400-stream":
            return JSONResponse(
                {"error": {"message": "The input (9000 tokens) is longer than the context"}},
                status_code=400,
            )
        if rid == "shape":
            return JSONResponse({"text": "hi", "output_ids": [1]})
        if rid == "batch":
            return JSONResponse([good_chunk(1, True)])
        if rid == "hang":
            await asyncio.sleep(hang_s)
            return JSONResponse(good_chunk(1, True))
        if rid == "logprob-count":
            chunk = good_chunk(2, True)
            chunk["meta_info"]["output_token_logprobs"].pop()
            return JSONResponse(chunk)

        async def chunks() -> AsyncIterator[bytes]:
            if rid == "no-done":
                yield _sse(good_chunk(1, False))
                yield _sse(good_chunk(2, False))
            elif rid == "finished-no-done":
                yield _sse(good_chunk(1, False))
                yield _sse(good_chunk(2, True))
            elif rid == "midstream-error":
                yield _sse(good_chunk(1, False))
                yield _sse({"error": {"message": "detokenizer crashed"}})
                yield b"data: [DONE]\n\n"
            elif rid == "bad-counts":
                yield _sse(good_chunk(1, False))
                bad = good_chunk(4, True)
                bad["output_ids"] = bad["output_ids"][:2]  # 2 ids, 4 tokens, 1 seen
                yield _sse(bad)
                yield b"data: [DONE]\n\n"
            elif rid == "stall":
                yield _sse(good_chunk(1, False))
                await asyncio.sleep(hang_s)
                yield b"data: [DONE]\n\n"
            elif rid == "garbage-chunk":
                yield b"data: {not json\n\n"
            elif rid == "after-final":
                yield _sse(good_chunk(1, True))
                yield _sse(good_chunk(1, True))
                yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        app.state.hits["get_model_info"] += 1
        if app.state.hits["get_model_info"] == 1:
            await asyncio.sleep(hang_s)
        return {"model_path": "/m", "weight_version": "default"}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n",
            status_code=400,
        )

    return app


def _req(n: int = 6, **kw: Any) -> GenerateRequest:
    return GenerateRequest(
        input_ids=PROMPT, sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0), **kw
    )


async def _collect(client: SGLangClient, req: GenerateRequest) -> list[StreamDelta]:
    return [d async for d in client.stream(req)]


# --- the happy paths ---------------------------------------------------------------------


async def test_generate_sends_token_request_and_parses_answer() -> None:
    app = sglang_app()
    with serve(app) as url:
        async with SGLangClient(url) as client:
            out = await client.generate(_req(5, rid="r1", stream=True))
    ids, lps = _tokens(PROMPT, 5)
    assert out.output_ids == ids
    assert [e[0] for e in out.meta_info.output_token_logprobs] == lps
    assert out.meta_info.finish_reason is not None
    assert out.meta_info.finish_reason.type == "length"
    assert out.meta_info.weight_version == "v1"
    sent = app.state.bodies[0]
    assert sent["stream"] is False  # forced off, whatever the request said
    assert sent["input_ids"] == PROMPT
    assert sent["rid"] == "r1"
    assert sent["return_logprob"] is True
    assert "text" not in sent  # token ids in, never text
    assert "sampling_seed" not in sent  # unset options are left out, not sent as null


@pytest.mark.parametrize("mode", ["cumulative", "incremental", "mixed", "logprobs_only"])
async def test_stream_yields_only_new_tokens_in_every_mode(mode: str) -> None:
    with serve(sglang_app(mode)) as url:
        async with SGLangClient(url) as client:
            full = await client.generate(_req(7))
            deltas = await _collect(client, _req(7))
    ids, lps = _tokens(PROMPT, 7)
    assert [len(d.token_ids) for d in deltas] == [1, 2, 1, 1, 1, 1]
    assert [t for d in deltas for t in d.token_ids] == ids == full.output_ids
    assert [lp for d in deltas for lp in d.logprobs] == lps
    assert [d.completion_tokens for d in deltas] == [1, 3, 4, 5, 6, 7]
    assert all(d.finish_reason is None for d in deltas[:-1])
    last = deltas[-1].finish_reason
    assert last is not None and last.type == "length"
    assert {d.weight_version for d in deltas} == {"v1"}
    assert {d.prompt_tokens for d in deltas} == {len(PROMPT)}


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
async def test_stream_top_logprobs_are_sliced_like_tokens(mode: str) -> None:
    with serve(sglang_app(mode)) as url:
        async with SGLangClient(url) as client:
            deltas = await _collect(client, _req(5, top_logprobs_num=2))
    tops = [t for d in deltas for t in d.top_logprobs]
    ids, _ = _tokens(PROMPT, 5)
    assert [t[0][1] for t in tops if t is not None] == ids


async def test_stream_without_logprobs() -> None:
    with serve(sglang_app("incremental")) as url:
        async with SGLangClient(url) as client:
            deltas = await _collect(client, _req(4, return_logprob=False))
    assert [t for d in deltas for t in d.token_ids] == _tokens(PROMPT, 4)[0]
    assert all(d.logprobs == [] for d in deltas)


async def test_control_endpoints() -> None:
    app = sglang_app()
    with serve(app) as url:
        async with SGLangClient(url) as client:
            assert await client.health() is True
            info = await client.get_model_info()
            assert info.model_path == "/models/tiny"
            assert info.weight_version == "v1"
            await client.abort("r7")
            await client.abort_all()
            res = await client.update_weights_from_disk("/ckpt/step2", weight_version="step2")
            assert res.success and "step2" in res.message
            await client.flush_cache()
    assert app.state.bodies[0] == {"rid": "r7", "abort_all": False}
    assert app.state.bodies[1] == {"rid": "", "abort_all": True}
    assert app.state.bodies[2] == {"model_path": "/ckpt/step2", "weight_version": "step2"}


async def test_update_weights_failure_raises_with_engine_message() -> None:
    app = sglang_app()
    with serve(app) as url:
        async with SGLangClient(url) as client:
            with pytest.raises(EngineError, match="missing-ckpt not found"):
                await client.update_weights_from_disk("/missing-ckpt")
    assert len(app.state.bodies) == 1  # never retried


# --- closing a stream early ------------------------------------------------------------


async def test_closing_stream_early_closes_the_http_response() -> None:
    app = sglang_app("incremental", chunk_delay=0.05)
    with serve(app) as url:
        async with SGLangClient(url) as client:
            async with aclosing(client.stream(_req(200))) as stream:
                got = 0
                async for delta in stream:
                    got += len(delta.token_ids)
                    if got >= 3:
                        break
            # The server sees the disconnect (SGLang aborts the request on it).
            assert await asyncio.to_thread(app.state.stream_closed.wait, 5.0)
            assert await client.health()  # the pool still works


async def test_cancelling_a_stream_consumer_closes_the_http_response() -> None:
    app = sglang_app("cumulative", chunk_delay=0.05)
    with serve(app) as url:
        async with SGLangClient(url) as client:
            first = asyncio.Event()

            async def consume() -> None:
                async for _ in client.stream(_req(200)):
                    first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), 5.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(app.state.stream_closed.wait, 5.0)


# --- misbehaving engines -----------------------------------------------------------------


async def test_error_answers_are_typed_and_never_retried() -> None:
    app = broken_app()
    with serve(app) as url:
        async with SGLangClient(url, retries=3) as client:
            with pytest.raises(EngineProtocolError, match="not JSON") as exc_info:
                await client.generate(_req(rid="garbage"))
            assert url in str(exc_info.value)

            with pytest.raises(EngineStatusError, match="CUDA out of memory") as status:
                await client.generate(_req(rid="error500"))
            assert status.value.status_code == 500
            assert status.value.engine_message == "CUDA out of memory"

            with pytest.raises(EngineProtocolError, match="meta_info"):
                await client.generate(_req(rid="shape"))
            with pytest.raises(EngineProtocolError, match="GenerateResponse"):
                await client.generate(_req(rid="batch"))
            with pytest.raises(EngineProtocolError, match="1 logprobs"):
                await client.generate(_req(rid="logprob-count"))

            with pytest.raises(EngineStatusError, match="longer than the context") as status:
                await _collect(client, _req(rid="error400-stream"))
            assert status.value.status_code == 400

            assert await client.health() is False  # 503
            with pytest.raises(EngineStatusError, match="will not be performed"):
                await client.flush_cache()
    for rid in ("garbage", "error500", "shape", "batch", "logprob-count", "error400-stream"):
        assert app.state.hits[rid] == 1, rid


async def test_timeouts_retry_gets_only() -> None:
    app = broken_app(hang_s=1.0)
    with serve(app) as url:
        async with SGLangClient(url, timeout=0.3, retries=2) as client:
            started = time.monotonic()
            with pytest.raises(EngineTimeout, match=r"no answer within 0\.3s"):
                await client.generate(_req(rid="hang"))
            assert time.monotonic() - started < 0.9
            # A GET may be repeated: the first call hangs, the retry answers.
            info = await client.get_model_info()
            assert info.model_path == "/m"
            with pytest.raises(EngineTimeout, match="after 1 tokens"):
                await _collect(client, _req(rid="stall"))
    assert app.state.hits["hang"] == 1
    assert app.state.hits["stall"] == 1
    assert app.state.hits["get_model_info"] == 2


@pytest.mark.parametrize(
    ("rid", "error", "match"),
    [
        ("no-done", EngineProtocolError, "without \\[DONE\\]"),
        ("midstream-error", EngineStatusError, "detokenizer crashed"),
        ("bad-counts", EngineProtocolError, "neither cumulative nor incremental"),
        ("garbage-chunk", EngineProtocolError, "not JSON"),
        ("after-final", EngineProtocolError, "after the final chunk"),
    ],
)
async def test_broken_streams(rid: str, error: type[Exception], match: str) -> None:
    app = broken_app()
    with serve(app) as url:
        async with SGLangClient(url) as client:
            with pytest.raises(error, match=match):
                await _collect(client, _req(rid=rid))
    assert app.state.hits[rid] == 1


async def test_finished_stream_without_done_is_accepted() -> None:
    with serve(broken_app()) as url:
        async with SGLangClient(url) as client:
            deltas = await _collect(client, _req(rid="finished-no-done"))
    assert [t for d in deltas for t in d.token_ids] == _tokens(PROMPT, 2)[0]
    assert deltas[-1].finish_reason is not None


async def test_closed_port_is_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with SGLangClient(url, retries=1) as client:
        with pytest.raises(EngineUnavailable, match=f"cannot connect to the engine at {url}"):
            await client.generate(_req())
        with pytest.raises(EngineUnavailable):
            await _collect(client, _req())
        with pytest.raises(EngineUnavailable):
            await client.update_weights_from_disk("/x")
        assert await client.health() is False


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="http"):
        SGLangClient("127.0.0.1:30000")
    with pytest.raises(ValueError, match="retries"):
        SGLangClient("http://127.0.0.1:1", retries=-1)


# --- retries -----------------------------------------------------------------------------


@contextmanager
def _serve_later(app: FastAPI, port: int, delay: float) -> Iterator[None]:
    """Start ``app`` on ``port`` only after ``delay`` seconds (an engine still booting)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))

    def run() -> None:
        time.sleep(delay)
        server.run()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)


async def test_connect_failures_are_retried_then_sent_once() -> None:
    app = sglang_app()
    port = free_port()
    with _serve_later(app, port, delay=0.25):
        # Backoff 0.1 + 0.2 + 0.4 + 0.8 s: the server is up before retries run out.
        async with SGLangClient(f"http://127.0.0.1:{port}", retries=4) as client:
            out = await client.generate(_req(3))
    assert out.output_ids == _tokens(PROMPT, 3)[0]
    assert len(app.state.bodies) == 1


class _HangUpServer:
    """A raw TCP server that reads each request's head and hangs up without answering:
    the request reached the 'engine', so only idempotent calls may be sent again."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, path = head.decode().split(" ")[:2]
        self.requests[f"{method} {path}"] += 1
        writer.close()
        await writer.wait_closed()


async def test_reset_after_sending_is_retried_for_idempotent_calls_only() -> None:
    hangup = _HangUpServer()
    async with hangup as url, SGLangClient(url, retries=2) as client:
        with pytest.raises(EngineUnavailable, match="lost"):
            await client.generate(_req())
        with pytest.raises(EngineUnavailable, match="lost"):
            await _collect(client, _req())
        with pytest.raises(EngineUnavailable, match="lost"):
            await client.update_weights_from_disk("/ckpt")
        with pytest.raises(EngineUnavailable, match="lost"):
            await client.get_model_info()
        with pytest.raises(EngineUnavailable, match="lost"):
            await client.abort("r1")
        assert await client.health() is False
    assert hangup.requests == {
        "POST /generate": 2,  # one generate + one stream, each sent once
        "POST /update_weights_from_disk": 1,
        "GET /get_model_info": 3,
        "POST /abort_request": 3,
        "GET /health": 3,
    }


class _DribbleServer:
    """A raw TCP server that answers every request with one SSE body written a few bytes
    at a time, so that lines and UTF-8 characters arrive split across network chunks."""

    def __init__(self, body: bytes, piece: int = 7) -> None:
        self.body = body
        self.piece = piece
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        )
        for i in range(0, len(self.body), self.piece):
            writer.write(self.body[i : i + self.piece])
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()
        await writer.wait_closed()


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
async def test_stream_lines_split_across_network_chunks(ending: bytes) -> None:
    ids, lps = _tokens(PROMPT, 3)
    events = []
    for k in (1, 3):
        chunk = {
            # Multi-byte characters and a raw U+2028 (as orjson writes it) in the text.
            "text": "h\u00e9\u2028\u4e16" * k,
            "output_ids": ids[:k],
            "meta_info": {
                "finish_reason": {"type": "length", "length": 3} if k == 3 else None,
                "prompt_tokens": 3,
                "completion_tokens": k,
                "output_token_logprobs": [
                    [lp, i, None] for lp, i in zip(lps[:k], ids[:k], strict=True)
                ],
            },
        }
        line = b"data: " + json.dumps(chunk, ensure_ascii=False).encode()
        events.append(b": keep-alive" + ending + line + ending + ending)
    body = b"".join(events) + b"data: [DONE]" + ending + ending
    async with _DribbleServer(body) as url, SGLangClient(url) as client:
        deltas = await _collect(client, _req(3))
    assert [len(d.token_ids) for d in deltas] == [1, 2]
    assert [t for d in deltas for t in d.token_ids] == ids
    assert [lp for d in deltas for lp in d.logprobs] == lps
    assert deltas[-1].finish_reason is not None


def test_client_is_bound_to_no_event_loop() -> None:
    """Built outside any loop; usable in one loop, then in another; closable after its
    loop is gone; closed for good after ``aclose()``."""
    idle = SGLangClient("http://127.0.0.1:1")
    asyncio.run(idle.aclose())  # never opened a session
    asyncio.run(idle.aclose())  # idempotent
    with serve(sglang_app()) as url:
        client = SGLangClient(url)
        assert asyncio.run(client.health()) is True
        assert asyncio.run(client.health()) is True  # a new loop: a new session
        asyncio.run(client.aclose())  # the session's loop is closed by now
        asyncio.run(client.aclose())
        with pytest.raises(EngineUnavailable, match="closed"):
            asyncio.run(client.get_model_info())
        assert asyncio.run(client.health()) is False


# --- the real local engine ---------------------------------------------------------------


async def test_against_the_local_engine(tmp_path: Path) -> None:
    """generate and stream agree on the real local engine (greedy).

    Uses the tiny model without imprinting: agreement needs real weights, not good answers,
    and the imprinted ``tiny_model_dir`` build takes minutes on a loaded 2-core machine.
    """
    server = pytest.importorskip("corral.engines.local.server")
    from corral.engines.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", imprint=False)
    app = server.build_engine_app(server.LocalEngine(model_dir))
    with serve(app) as url:
        async with SGLangClient(url) as client:
            assert await client.health()
            req = GenerateRequest(
                input_ids=[1, 2, 3, 4],
                sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0),
            )
            full = await client.generate(req)
            deltas = await _collect(client, req)
    assert [t for d in deltas for t in d.token_ids] == full.output_ids
    streamed = [lp for d in deltas for lp in d.logprobs]
    assert streamed == pytest.approx([e[0] for e in full.meta_info.output_token_logprobs])
    assert deltas[-1].finish_reason == full.meta_info.finish_reason
