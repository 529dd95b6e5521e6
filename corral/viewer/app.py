"""The viewer's web app: JSON routes over :mod:`corral.viewer.reader` and the static page.

Read-only and meant for a loopback port: only GET routes; every answer is JSON built from
scrubbed records (:mod:`corral.viewer.redact`) or a file of ``static/``; a Host header other
than a loopback name is refused (a page on another site cannot reach the viewer through DNS
rebinding); a strict Content-Security-Policy allows only the page's own script and style (an
escaping slip in the page still runs no injected script). A live gateway's admin token stays
in this process: the page never sees it.

Routes (``{set}``: an episode set's id, ``{line}``: an episode's line in it):

- ``GET /api/sources``: the sources and their sets;
- ``GET /api/runs/{source}``: a run's metrics lines and dropped groups;
- ``GET /api/episodes``: every episode as columns (:data:`~corral.viewer.reader.LIST_COLUMNS`);
- ``GET /api/episodes/{set}/{line}``: one episode;
- ``GET /api/episodes/{set}/{line}/samples/{n}``: one sample, token by token;
- ``GET /api/compare?a={set}&b={set}``: paired reward differences;
- ``GET /api/gateway/sessions``: a live gateway's open sessions (the newest first);
  ``GET /api/gateway/sessions/{id}`` and ``.../samples/{n}``: one session.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.viewer import reader
from corral.viewer.gateway_source import GatewaySource, GatewaySourceError
from corral.viewer.pieces import Pieces
from corral.viewer.reader import EpisodeSet, Source, ViewerError

STATIC = Path(__file__).parent / "static"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
# No inline script or style, nothing from elsewhere; data: images for the page's own icons.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@dataclass
class ViewerState:
    """What the app serves: the sources and their sets (indexed once, at start), a token
    decoder for the sample view, and a live gateway, if one was given."""

    sources: list[Source]
    sets: list[EpisodeSet]
    pieces: Pieces | None = None
    gateway: GatewaySource | None = None

    def set_of(self, raw: str) -> EpisodeSet:
        try:
            number = int(raw)
        except ValueError:
            raise ViewerError(f"no episode set {raw!r}") from None
        if not 0 <= number < len(self.sets):
            raise ViewerError(f"no episode set {number}")
        return self.sets[number]


def open_state(
    paths: Sequence[Path],
    *,
    pieces: Pieces | None = None,
    gateway: GatewaySource | None = None,
) -> ViewerState:
    """Index the folders at ``paths`` (:class:`~corral.viewer.reader.ViewerError` for one
    that is not a corral folder)."""
    sources, sets = reader.open_sources(paths)
    return ViewerState(sources, sets, pieces, gateway)


def create_app(state: ViewerState, *, allowed_hosts: Sequence[str] = LOOPBACK_HOSTS) -> Starlette:
    """The viewer's ASGI app over ``state`` (module docstring)."""

    def api(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                body = await handler(request)
            except ViewerError as exc:
                return JSONResponse({"error": str(exc)}, status_code=404)
            except GatewaySourceError as exc:
                return JSONResponse({"error": str(exc)}, status_code=502)
            return JSONResponse(body)

        return endpoint

    async def sources(_: Request) -> Any:
        return {
            "sources": [s.info() for s in state.sources],
            "sets": [s.info() for s in state.sets],
            "gateway": None if state.gateway is None else state.gateway.url,
            "columns": list(reader.LIST_COLUMNS),
            "tokenizer": state.pieces is not None,
        }

    async def run(request: Request) -> Any:
        number = int(request.path_params["source"])
        if not 0 <= number < len(state.sources):
            raise ViewerError(f"no source {number}")
        return await asyncio.to_thread(reader.run_metrics, state.sources[number])

    async def episodes(request: Request) -> Any:
        wanted = request.query_params.get("set")
        sets = state.sets if wanted is None else [state.set_of(wanted)]
        return reader.episode_columns(sets)

    async def episode(request: Request) -> Any:
        episode_set = state.set_of(request.path_params["set"])
        return await asyncio.to_thread(
            reader.episode_detail, episode_set, int(request.path_params["line"])
        )

    async def sample(request: Request) -> Any:
        episode_set = state.set_of(request.path_params["set"])
        return await asyncio.to_thread(
            reader.sample_detail,
            episode_set,
            int(request.path_params["line"]),
            int(request.path_params["n"]),
            state.pieces,
        )

    async def compare(request: Request) -> Any:
        a = state.set_of(request.query_params.get("a", ""))
        b = state.set_of(request.query_params.get("b", ""))
        return reader.compare_sets(a, b)

    async def gateway_sessions(_: Request) -> Any:
        if state.gateway is None:
            raise ViewerError("the viewer was not given a gateway")
        return await state.gateway.sessions()

    async def gateway_session(request: Request) -> Any:
        if state.gateway is None:
            raise ViewerError("the viewer was not given a gateway")
        return await state.gateway.session(request.path_params["session_id"])

    async def gateway_sample(request: Request) -> Any:
        if state.gateway is None:
            raise ViewerError("the viewer was not given a gateway")
        return await state.gateway.sample(
            request.path_params["session_id"], int(request.path_params["n"]), state.pieces
        )

    async def index(_: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    int_ = "{%s:int}"
    routes = [
        Route("/", index),
        Route("/api/sources", api(sources)),
        Route(f"/api/runs/{int_ % 'source'}", api(run)),
        Route("/api/episodes", api(episodes)),
        Route("/api/episodes/{set}/" + int_ % "line", api(episode)),
        Route("/api/episodes/{set}/" + int_ % "line" + "/samples/" + int_ % "n", api(sample)),
        Route("/api/compare", api(compare)),
        Route("/api/gateway/sessions", api(gateway_sessions)),
        Route("/api/gateway/sessions/{session_id}", api(gateway_session)),
        Route("/api/gateway/sessions/{session_id}/samples/" + int_ % "n", api(gateway_sample)),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        if state.gateway is not None:
            await state.gateway.aclose()

    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)),
            Middleware(_Hardened),
        ],
        lifespan=lifespan,
    )
    return app


class _Hardened:
    """Refuses every method but GET and HEAD (the viewer changes nothing) and adds the
    security headers to every answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            await JSONResponse({"error": "the viewer is read-only"}, status_code=405)(
                scope, receive, send
            )
            return

        async def send_hardened(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                    (b"cache-control", b"no-store"),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_hardened)
