"""Start real servers on 127.0.0.1 for tests (uvicorn in a background thread), the stand-in
gateway the agent bridge's tests talk to (aiohttp on the test's own loop), and raw sockets for
the tests that attack a server's transport."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from corral.serving import free_port
from corral.serving import serve_in_thread as serve

__all__ = ["Gateway", "free_port", "raw_connect", "read_until_closed", "serve", "stand_in_gateway"]


def raw_connect(port: int, timeout_s: float) -> socket.socket:
    """A plain TCP connection to 127.0.0.1:``port`` whose every call waits at most
    ``timeout_s`` (a bound for the test, never a way to wait for the server)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.settimeout(timeout_s)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the socket (a reset counts as closed;
    raises on the socket's timeout)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class Gateway:
    """The stand-in gateway's origin and what it was asked (method, path, body)."""

    origin: str
    requests: list[tuple[str, str, bytes]]
    hanging: asyncio.Event


@asynccontextmanager
async def stand_in_gateway(*, max_body_bytes: int = 2**20) -> AsyncIterator[Gateway]:
    """A real HTTP server on 127.0.0.1 standing as the gateway (the bridge is what is tested,
    not the gateway): it records every request and answers ``reply to <path>``; a request to
    ``/v1/echo...`` gets its body back reversed, one to ``/v1/hanging`` sets ``hanging``.
    Bodies over ``max_body_bytes`` get aiohttp's 413."""
    seen: list[tuple[str, str, bytes]] = []
    hanging = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((request.method, request.path, body))
        if request.path == "/v1/hanging":
            hanging.set()
        if request.path.startswith("/v1/echo"):
            return web.Response(body=body[::-1])
        return web.Response(text=f"reply to {request.path}")

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield Gateway(f"http://127.0.0.1:{port}", seen, hanging)
    finally:
        await runner.cleanup()
