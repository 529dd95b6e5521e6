"""A scripted TEST engine: SGLang's native HTTP API, answering with token ids a test chose.

This is a test double, not an engine and not SGLang: it runs no model. It speaks the subset
of SGLang's API that corral's client (``corral.engines.sglang.SGLangClient``, models in
``corral.engines.protocol``) uses, in SGLang's own shapes, so that the gateway and anything
else behind that client can be driven turn by turn with exact, known tokens:

- ``POST /generate``: the body must be a ``GenerateRequest`` (unknown fields are a 400, as on
  the local engine). Non-streaming: one JSON answer. ``stream: true``: server-sent events,
  SGLang's default cumulative chunks (every chunk holds ``output_ids``, ``text`` and
  ``output_token_logprobs`` of everything so far), ``chunk_tokens`` new tokens per chunk, the
  ``finish_reason`` on the last chunk only, then ``data: [DONE]``.
- ``POST /abort_request`` (``{rid}`` or ``{abort_all: true}``): a request still running ends
  with ``{"type": "abort"}`` at its next chunk boundary, keeping the tokens sent so far.
- ``GET /health`` (200, or 503 while ``healthy`` is false), ``GET /get_model_info``,
  ``POST|GET /flush_cache``, ``POST /update_weights_from_disk`` (sets ``weight_version``).

What each ``/generate`` answers is scripted: ``push()`` queues one script per upcoming
request, and requests take them in the order they arrive. A script is a list of token ids, a
callable from the request's ``input_ids`` to token ids, a ``Reply`` (ids with chosen
logprobs) or a ``Failure`` (an HTTP error answer). The engine plays the ids as a model would
have sampled them:

- at most ``sampling_params.max_new_tokens`` tokens; reaching it finishes with
  ``{"type": "length", "length": max_new_tokens}`` (checked first, as SGLang does);
- a stop token (``eos_token_ids`` plus the request's ``stop_token_ids``; neither with
  ``ignore_eos``) finishes with ``{"type": "stop", "matched": id}``; the stop token is kept
  in ``output_ids`` and the rest of the script is dropped;
- a script that runs out without either finishes with ``{"type": "stop", "matched": null}``
  (as a model stopped by a stop string would look to the client).

Each token's logprob is ``logprob`` (-0.5 unless set) unless the script gives them; with
``top_logprobs_num`` = k the alternatives at each position are the token itself, then ids
+1..k-1 at 1.0 lower logprob each. ``text`` is ``decode(output_ids)`` when a ``decode`` is
given, else empty (as SGLang with ``--skip-tokenizer-init``). No stop strings are applied.

Every request is kept in ``requests`` (a ``Received``: its ``GenerateRequest``, what was
answered, how it ended), so that a test can check recorded samples token-exact.
Thread-safe: serve ``engine.app`` with ``tests.servers.serve`` (uvicorn in another thread)
and push scripts or read ``requests`` from the test's thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from corral.engines.protocol import (
    AbortRequest,
    GenerateRequest,
    UpdateWeightsFromDiskRequest,
)

__all__ = ["Failure", "Received", "Reply", "Script", "ScriptedEngine"]


@dataclass(frozen=True)
class Reply:
    """Token ids to play, with their logprobs (one per id; None: the engine's default)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"{len(self.token_ids)} token ids but {len(self.logprobs)} logprobs in a Reply"
            )


@dataclass(frozen=True)
class Failure:
    """Answer the request with HTTP ``status`` and SGLang's error body ``{"error": {...}}``."""

    status: int = 500
    message: str = "scripted failure"


Script = Sequence[int] | Callable[[list[int]], Sequence[int] | Reply | Failure] | Reply | Failure


@dataclass
class Received:
    """One ``/generate`` request as the engine received it, and what it answered.

    ``output_ids``/``logprobs``/``finish_reason`` are filled as the answer is produced (the
    tokens actually sent, so a request aborted or disconnected mid-stream holds only those);
    ``disconnected`` is set when the client went away before the end of a stream.
    """

    request: GenerateRequest
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    status: int = 200
    disconnected: bool = False

    @property
    def input_ids(self) -> list[int]:
        return self.request.input_ids

    @property
    def sampling_params(self) -> Any:
        return self.request.sampling_params

    @property
    def rid(self) -> str | None:
        return self.request.rid

    @property
    def stream(self) -> bool:
        return self.request.stream


class ScriptedEngine:
    """The scripted test engine (see the module docstring); ``app`` is its Starlette app.

    ``eos_token_ids``: ids that stop generation like a model's EOS. ``chunk_tokens``: new tokens
    per streamed chunk (>= 1). ``delay_s``: a sleep before each chunk (streaming) or the same
    total before the answer (non-streaming), so that aborts and disconnects can land mid-way.
    ``default``: the script used when none was pushed (None: such a request gets a 500 naming
    the problem, so that a test that sent one request too many fails loudly).
    """

    def __init__(
        self,
        *,
        eos_token_ids: Iterable[int] = (),
        chunk_tokens: int = 3,
        logprob: float = -0.5,
        weight_version: str = "default",
        model_path: str = "scripted-test-engine",
        decode: Callable[[list[int]], str] | None = None,
        delay_s: float = 0.0,
        default: Script | None = None,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chunk_tokens = chunk_tokens
        self.logprob = logprob
        self.weight_version = weight_version
        self.model_path = model_path
        self.decode = decode
        self.delay_s = delay_s
        self.default = default
        self.healthy = True
        self.aborts: list[dict[str, Any]] = []  # the bodies of /abort_request, in order
        self.flushes = 0
        self._lock = threading.Lock()
        self._scripts: deque[Script] = deque()
        self._requests: list[Received] = []
        self._aborted: set[str] = set()
        self._abort_all_epoch = 0
        self.app = self._build_app()

    # --- the test's side ----------------------------------------------------------------

    def push(self, *scripts: Script) -> None:
        """Queue scripts for the next requests, in order (one per request)."""
        with self._lock:
            self._scripts.extend(scripts)

    @property
    def pending(self) -> int:
        """How many pushed scripts no request has taken yet."""
        with self._lock:
            return len(self._scripts)

    @property
    def requests(self) -> list[Received]:
        """Every ``/generate`` request so far, in arrival order (a copy of the list)."""
        with self._lock:
            return list(self._requests)

    def clear(self) -> None:
        """Forget queued scripts, recorded requests and aborts."""
        with self._lock:
            self._scripts.clear()
            self._requests.clear()
            self.aborts.clear()
            self._aborted.clear()

    # --- the engine's side --------------------------------------------------------------

    def _next_script(self, received: Received) -> Script | None:
        with self._lock:
            self._requests.append(received)
            if self._scripts:
                return self._scripts.popleft()
            return self.default

    def _resolve(self, script: Script, input_ids: list[int]) -> Reply | Failure:
        if callable(script) and not isinstance(script, Reply | Failure):
            script = script(list(input_ids))
        if isinstance(script, Reply | Failure):
            return script
        return Reply(token_ids=[int(t) for t in script])

    def _play(
        self, req: GenerateRequest, reply: Reply
    ) -> tuple[list[int], list[float], dict[str, Any]]:
        """The ids, logprobs and finish reason a model would have produced for ``reply``."""
        p = req.sampling_params
        stop_ids = (
            frozenset() if p.ignore_eos else self.eos_token_ids | frozenset(p.stop_token_ids or ())
        )
        ids: list[int] = []
        finish: dict[str, Any] = {"type": "stop", "matched": None}
        for token in reply.token_ids:
            if len(ids) >= p.max_new_tokens:
                break
            ids.append(int(token))
            if len(ids) >= p.max_new_tokens:  # length first, as SGLang checks it
                break
            if token in stop_ids:
                finish = {"type": "stop", "matched": int(token)}
                break
        if len(ids) >= p.max_new_tokens:
            finish = {"type": "length", "length": p.max_new_tokens}
        if reply.logprobs is not None:
            logprobs = [float(lp) for lp in reply.logprobs[: len(ids)]]
        else:
            logprobs = [self.logprob] * len(ids)
        return ids, logprobs, finish

    def _was_aborted(self, rid: str, epoch: int) -> bool:
        with self._lock:
            return rid in self._aborted or self._abort_all_epoch != epoch

    def _chunk(
        self,
        req: GenerateRequest,
        rid: str,
        ids: list[int],
        lps: list[float],
        finish: dict[str, Any] | None,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, lps, strict=True)]
            if req.top_logprobs_num:
                k = req.top_logprobs_num
                meta["output_top_logprobs"] = [
                    [[lp - j, t + j, None] for j in range(k)]
                    for t, lp in zip(ids, lps, strict=True)
                ]
        return {
            "text": self.decode(list(ids)) if self.decode is not None else "",
            "output_ids": list(ids),
            "meta_info": meta,
        }

    async def _chunks(
        self, req: GenerateRequest, rid: str, received: Received, reply: Reply
    ) -> AsyncIterator[dict[str, Any]]:
        """Cumulative chunks of ``chunk_tokens`` new tokens; the last carries the finish."""
        with self._lock:
            epoch = self._abort_all_epoch
        ids, lps, finish = self._play(req, reply)
        bounds = [*range(self.chunk_tokens, len(ids), self.chunk_tokens), len(ids)]
        for k in bounds:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self._was_aborted(rid, epoch):
                sent = len(received.output_ids)
                received.finish_reason = {"type": "abort", "message": f"Abort request {rid}"}
                yield self._chunk(req, rid, ids[:sent], lps[:sent], received.finish_reason)
                return
            last = k == len(ids)
            received.output_ids, received.logprobs = ids[:k], lps[:k]
            if last:
                received.finish_reason = finish
            yield self._chunk(req, rid, ids[:k], lps[:k], finish if last else None)

    # --- HTTP -----------------------------------------------------------------------------

    def _build_app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            try:
                req = GenerateRequest.model_validate(json.loads(await request.body() or b"{}"))
            except (ValueError, ValidationError) as exc:
                return _error(f"invalid GenerateRequest: {exc}", 400)
            rid = req.rid or uuid.uuid4().hex
            received = Received(request=req)
            script = self._next_script(received)
            if script is None:
                n = len(self.requests)
                received.status = 500
                return _error(f"scripted engine: no script left for request #{n}", 500)
            reply = self._resolve(script, req.input_ids)
            if isinstance(reply, Failure):
                received.status = reply.status
                return _error(reply.message, reply.status)

            if not req.stream:
                last: dict[str, Any] = {}
                async for chunk in self._chunks(req, rid, received, reply):
                    last = chunk
                return JSONResponse(last)

            async def events() -> AsyncIterator[bytes]:
                finished = False
                try:
                    async for chunk in self._chunks(req, rid, received, reply):
                        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                    finished = True
                    yield b"data: [DONE]\n\n"
                finally:
                    if not finished:  # Starlette cancels this when the client goes away
                        received.disconnected = True

            return StreamingResponse(events(), media_type="text/event-stream")

        async def abort_request(request: Request) -> Response:
            try:
                req = AbortRequest.model_validate(json.loads(await request.body() or b"{}"))
            except (ValueError, ValidationError) as exc:
                return _error(f"invalid AbortRequest: {exc}", 400)
            with self._lock:
                self.aborts.append(req.model_dump())
                if req.abort_all:
                    self._abort_all_epoch += 1
                elif req.rid:
                    self._aborted.add(req.rid)
            return Response(status_code=200)

        async def health(_: Request) -> Response:
            return Response(status_code=200 if self.healthy else 503)

        async def get_model_info(_: Request) -> Response:
            return JSONResponse(
                {
                    "model_path": self.model_path,
                    "tokenizer_path": self.model_path,
                    "is_generation": True,
                    "preferred_sampling_params": None,
                    "weight_version": self.weight_version,
                }
            )

        async def flush_cache(_: Request) -> Response:
            with self._lock:
                self.flushes += 1
            return PlainTextResponse("Cache flushed.\n")

        async def update_weights_from_disk(request: Request) -> Response:
            try:
                body = json.loads(await request.body() or b"{}")
                req = UpdateWeightsFromDiskRequest.model_validate(body)
            except (ValueError, ValidationError) as exc:
                return _error(f"invalid UpdateWeightsFromDiskRequest: {exc}", 400)
            if req.weight_version:
                self.weight_version = req.weight_version
            return JSONResponse(
                {
                    "success": True,
                    "message": "Succeeded to update model weights.",
                    "num_paused_requests": 0,
                }
            )

        return Starlette(
            routes=[
                Route("/generate", generate, methods=["POST"]),
                Route("/abort_request", abort_request, methods=["POST"]),
                Route("/health", health, methods=["GET"]),
                Route("/get_model_info", get_model_info, methods=["GET"]),
                Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
                Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
            ]
        )


def _error(message: str, status: int) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)
