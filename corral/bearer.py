"""A bearer-token gate for any ASGI app: what the local engine and the MCP tool server put in
front of their routes.

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, which would get between a route and
its client's disconnects (the engine aborts a request when its client goes). The token is
compared as bytes with ``hmac.compare_digest``: constant time in its content, and a non-ASCII
header is a 401, not a 500.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send


def bearer_of(scope: Scope) -> bytes:
    """The bearer token of the request's ``Authorization`` header, as sent (b"" if none)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


class BearerGate:
    """ASGI middleware: an HTTP request to a path outside ``open_paths`` without ``token`` as
    its bearer is answered 401 (``refusal`` as its JSON body, ``WWW-Authenticate: Bearer``) and
    never reaches ``app``; lifespan and other events pass through. ``ValueError`` for an empty
    token (it would guard nothing)."""

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        *,
        open_paths: Iterable[str] = (),
        refusal: Any = None,
    ) -> None:
        if not token:
            raise ValueError("an empty bearer token would guard nothing")
        self.app = app
        self._token = token.encode()
        self._open = frozenset(open_paths)
        self._body = json.dumps(
            {"error": "missing or wrong bearer token"} if refusal is None else refusal
        ).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] in self._open
            or hmac.compare_digest(bearer_of(scope), self._token)
        ):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(self._body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": self._body})
