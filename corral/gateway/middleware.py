"""ASGI middleware of the gateway: body limits and request ids."""

from __future__ import annotations

import json
import re
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.gateway.errors import GatewayError

REQUEST_ID_HEADER = b"x-request-id"
# A client's own request id is echoed only when it is a short token (no header injection).
_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


class RequestId:
    """Puts an ``x-request-id`` on every answer: the client's own (when it is a short printable
    token) or a new one. The id is in ``scope["state"]["request_id"]`` for the handlers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", [])).get(REQUEST_ID_HEADER, b"")
        rid = given if _ID.fullmatch(given) else ("req_" + secrets.token_hex(12)).encode()
        scope.setdefault("state", {})["request_id"] = rid.decode()

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER, rid))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_id)


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
                await _too_large(send, self.max_bytes, scope)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise GatewayError(
                        "too_large",
                        f"the body is over {self.max_bytes} bytes",
                        code="body_too_large",
                    )
            return message

        await self.app(scope, limited, send)


async def _too_large(send: Send, max_bytes: int, scope: Scope) -> None:
    error = GatewayError("too_large", f"the body is over {max_bytes} bytes", code="body_too_large")
    body = error.anthropic_body() if speaks_anthropic(scope) else error.openai_body()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def speaks_anthropic(scope: Scope) -> bool:
    """Whether a request is Anthropic's (its path or its headers say so): its errors then take
    Anthropic's shape."""
    path = str(scope.get("path", ""))
    if path.endswith("/v1/messages") or "/v1/messages/" in path:
        return True
    headers = dict(scope.get("headers", []))
    return b"anthropic-version" in headers or b"x-api-key" in headers
