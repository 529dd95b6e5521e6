"""What a dialect is to the HTTP layer, and the helpers every dialect shares."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers, QueryParams

from corral.gateway.errors import GatewayError, bad_request
from corral.gateway.sessions import Session
from corral.gateway.turns import TurnEvent, TurnRequest, TurnResult

M = TypeVar("M", bound=BaseModel)

# A stream is a sequence of event batches: the events one engine delta produced, so that a
# dialect can put what belongs together (a text delta and its logprobs) into one frame.
EventBatches = AsyncIterator[Sequence[TurnEvent]]


@dataclass(frozen=True)
class RequestContext:
    """What a dialect may look at besides the body: the session and the request's headers
    and query (never the HTTP request itself)."""

    session: Session
    headers: Headers
    query: QueryParams


class Dialect(Protocol):
    """One wire format over the pipeline.

    ``parse`` raises :class:`GatewayError` naming what is wrong or cannot be honoured;
    ``frame`` must turn a :class:`GatewayError` raised by the batches into its own error
    event (the headers are out by then) and must not raise it.
    """

    name: str

    def parse(self, data: dict[str, Any], ctx: RequestContext) -> TurnRequest: ...

    def render(self, result: TurnResult, request: TurnRequest, ctx: RequestContext) -> bytes: ...

    def frame(
        self, batches: EventBatches, request: TurnRequest, ctx: RequestContext
    ) -> AsyncGenerator[str, None]: ...

    def error_body(self, error: GatewayError) -> dict[str, Any]: ...


def validate(model: type[M], data: dict[str, Any], *, prefix: str = "") -> M:
    """``data`` as ``model``; a 400 naming the first bad field otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, prefix=prefix) from None


def validation_error(exc: ValidationError, *, prefix: str = "") -> GatewayError:
    first = exc.errors()[0]
    # Union members appear in the location as their type ("literal['auto','none']"): the
    # client's field is the path before them.
    path = [str(p) for p in first["loc"]]
    cut = next((i for i, p in enumerate(path) if any(c in p for c in "['(")), len(path))
    where = prefix + ".".join(path[:cut]) or None
    if first["type"] == "extra_forbidden":
        message = f"unknown field '{where}': the gateway does not know it"
        code = "unsupported_field"
    else:
        message = f"invalid field '{where}': {first['msg']} ({first['type']})"
        code = "invalid_field"
    if len(exc.errors()) > 1:
        message += f" (and {len(exc.errors()) - 1} more problem(s))"
    return bad_request(message, param=where, code=code)


def refuse_extra_fields(cannot: Sequence[str], unknown: Sequence[str], *, api: str) -> None:
    """A 400 for the fields a request sent beyond those its dialect handles: first those
    ``api`` does not define (all named), then the ones it defines that the gateway cannot
    honour."""
    if unknown:
        named = ", ".join(f"'{k}'" for k in unknown)
        raise bad_request(
            f"unknown field(s) {named}: not part of {api}",
            param=unknown[0],
            code="unsupported_field",
        )
    if cannot:
        raise bad_request(
            f"unsupported field '{cannot[0]}': the gateway cannot honour it",
            param=cannot[0],
            code="unsupported_field",
        )


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event; ``data`` is JSON-encoded unless it is already text."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"
