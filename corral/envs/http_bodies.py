"""Reading the env server's HTTP request bodies: under a size cap, as bounded JSON, and watching
for a client that hangs up (``POST /reset``, ``/step``, ``/mcp``).

Every refusal is a :class:`~corral.envs.episodes.ServerError` with one of OpenEnv's codes; the
app turns it into its HTTP answer in one place (:func:`corral.envs.http_episodes.error_response`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.requests import Request

from corral.envs.episodes import ServerError
from corral.envs.protocol import MAX_FRAME_DEPTH, ErrorCode, Reason, depth, json_safe_errors

_T = TypeVar("_T")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read chunk by chunk; ServerError ``body_too_large`` (413) as soon as
    it is known to pass ``limit`` bytes, so an over-cap body is never held whole."""
    refusal = ServerError(
        ErrorCode.VALIDATION_ERROR,
        f"the request body is over {limit} bytes (the server's max_body_bytes)",
        Reason.BODY_TOO_LARGE,
        errors=[],
    )
    declared = request.headers.get("content-length", "")
    # isascii: "²" is a digit to isdigit but not to int; past 18 digits int() may refuse it too.
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise refusal
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise refusal
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request: Request, limit: int, *, allow_empty: bool = False) -> Any:
    """The request's JSON body (at most ``limit`` bytes; None for an empty one when
    ``allow_empty``); ServerError INVALID_JSON / VALIDATION_ERROR otherwise."""
    text = await read_body(request, limit)
    if allow_empty and not text.strip():
        return None
    try:
        body = json.loads(text)
    except RecursionError:
        raise ServerError(ErrorCode.INVALID_JSON, "the body is not JSON: too deep") from None
    except ValueError as exc:
        # ValueError, not only JSONDecodeError: bad UTF-8, and an integer past Python's digit
        # limit (4300), raise other ValueErrors.
        raise ServerError(ErrorCode.INVALID_JSON, f"the body is not JSON: {exc}") from None
    if depth(body) > MAX_FRAME_DEPTH:
        raise ServerError(
            ErrorCode.VALIDATION_ERROR,
            f"the body nests over {MAX_FRAME_DEPTH} levels deep",
            Reason.TOO_DEEP,
            errors=[],
        )
    return body


def validation_error(exc: ValidationError) -> ServerError:
    """A body that does not fit its model, as the VALIDATION_ERROR naming each problem."""
    errors = json_safe_errors(exc.errors())
    message = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors)
    return ServerError(ErrorCode.VALIDATION_ERROR, message, errors=errors)


async def unless_client_leaves(request: Request, work: Awaitable[_T]) -> _T | None:
    """``work``'s result, or None when the client hangs up first: then ``work`` is cancelled
    (an episode being created gives its slot back). The body must have been read."""

    async def hung_up() -> None:
        """Returns once the client has hung up; never, if that cannot be told."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:
            await asyncio.get_running_loop().create_future()  # let the work finish

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left (or this request was cancelled)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return None
    return task.result()
