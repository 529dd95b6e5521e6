"""The server-sent-events transport every dialect's stream goes out through."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStream(Response):
    """Server-sent events that stop the moment the client goes.

    Starlette's StreamingResponse on ASGI 2.4 servers only notices a disconnect when a send
    fails, and leaves the generator to the garbage collector; the engine would go on
    generating and the turn could be recorded. Here a watcher ends the stream on
    ``http.disconnect`` and the generator is always closed (its cleanup aborts the engine).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        # Not Response.__init__: it would declare a content-length for an empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        for name, value in (headers or {}).items():
            self.raw_headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
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
