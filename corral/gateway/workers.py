"""``corral gateway --workers N``: N gateway processes behind one address, each owning the
sessions it created.

Layout. The parent (:func:`run_workers`) binds the one TCP socket and starts N worker
processes (``python -m corral.gateway.workers``, each handed the socket's descriptor); they all
accept from that one socket, so the kernel hands each new connection to whichever worker is
free to accept it, and a dead worker's share simply goes to the others (no connection sits in a
dead process's queue, as it would with ``SO_REUSEPORT``). Each worker also serves the same app
on a Unix socket of its own (``worker-K.sock`` in a private folder, mode 0700) for requests
the others forward to it.

Ownership. Worker K makes every session id and every session api key start with ``wK.``
(:func:`worker_prefix`; ``GatewaySettings.session_id_prefix``): hex ids and url-safe keys never
hold a dot, so :func:`owner_of` reads the owner back exactly. A connection may reach any
worker; :class:`WorkerRouter`, around each worker's app, finds the owner of a request
(:func:`route`): the id in ``/sessions/{id}/...``, else the api key (``Authorization: Bearer``
or ``x-api-key``) of a ``/v1/...`` request. A request another worker owns is streamed to it
over its Unix socket and its answer streamed back as it comes (SSE included; status, headers
and body pass through, plus ``x-corral-forwarded-by: K`` naming the worker that forwarded it),
with a header carrying the gateway's secret so that it is served where
it lands and never forwarded again; an owner that is not running is a 503 in JSON. ``POST
/sessions`` is served where it lands (that worker becomes the owner). ``GET /sessions``,
``/health`` and ``/metrics`` ask every worker and answer for the whole gateway
(:func:`merge_pages`, :func:`merge_metrics`).

Supervision. The parent restarts a worker that exits (with its own journal folder,
``journal/worker-K``, it gets its sessions back), logs one line per start and exit, and on
SIGTERM / SIGINT stops them all (SIGTERM: each shuts down gracefully). A worker whose parent
is gone (killed) shuts down too: it watches a pipe only the parent holds open.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from corral.gateway.errors import GatewayError
from corral.gateway.middleware import speaks_anthropic

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The header a forwarded request carries (the gateway's secret): served where it lands.
FORWARDED_HEADER = "x-corral-worker-forwarded"
# On a forwarded request's answer: the worker that took the connection and forwarded it.
FORWARDED_BY_HEADER = b"x-corral-forwarded-by"
# The environment variable a worker process reads its WorkerSpec from.
SPEC_VARIABLE = "CORRAL_GATEWAY_WORKER_SPEC"
# The file in the journal folder naming how many workers wrote it.
JOURNAL_MARKER = "corral-gateway-workers.json"
# Hop-by-hop headers (RFC 9110 7.6.1) and those each side's server writes itself.
_REQUEST_DROPPED = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade"}
)
_RESPONSE_DROPPED = _REQUEST_DROPPED | {b"date", b"server"}
# Headers aiohttp would add on its own to a forwarded request: the owner must see the client's.
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_OWNER = re.compile(r"w(0|[1-9][0-9]{0,3})\.")
# A worker that dies this soon after it started is restarted after a growing pause.
_QUICK_EXIT_S = 10.0
_MAX_RESTART_PAUSE_S = 30.0
STOP_TIMEOUT_S = 30.0


# -- ownership ---------------------------------------------------------------------------------


def worker_prefix(index: int) -> str:
    """What starts the ids and api keys of worker ``index``'s sessions."""
    return f"w{index}."


def owner_of(value: str) -> int | None:
    """The worker a session id or api key belongs to (``wK.`` first), or None (no mark)."""
    found = _OWNER.match(value)
    return int(found.group(1)) if found else None


Where = Literal["here", "owner", "list", "health", "metrics"]


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: served ``here``, forwarded to its ``owner`` (``worker``), or
    answered for the whole gateway (``list``, ``health``, ``metrics``)."""

    where: Where
    worker: int | None = None


def _key_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The session key a request carries, as the gateway reads it: a bearer token, else
    ``x-api-key`` (the first of each header, as Starlette's ``headers.get`` reads them)."""
    authorization: str | None = None
    api_key: str | None = None
    for name, value in headers:
        if name == b"authorization" and authorization is None:
            authorization = value.decode("latin-1")
        elif name == b"x-api-key" and api_key is None:
            api_key = value.decode("latin-1")
    bearer = ""
    if authorization is not None:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer":
            bearer = token.strip()
    return bearer or (api_key or "").strip()


def route(
    method: str, path: str, headers: Iterable[tuple[bytes, bytes]], *, me: int, workers: int
) -> Route:
    """Where worker ``me`` of ``workers`` sends a request that was not forwarded to it."""
    parts = path.split("/")
    if len(parts) >= 3 and parts[1] == "sessions" and parts[2]:
        owner = owner_of(parts[2])  # /sessions/{id}[/...]
    elif path == "/sessions":
        return Route("list") if method == "GET" else Route("here")
    elif path == "/health":
        return Route("health")
    elif path == "/metrics":
        return Route("metrics")
    elif path.startswith("/v1/"):
        owner = owner_of(_key_of(headers))
    else:
        return Route("here")
    # An id or key with no mark, or one of no worker of this gateway: its own 404 or 401 here.
    if owner is None or owner == me or owner >= workers:
        return Route("here")
    return Route("owner", owner)


# -- answers for the whole gateway ---------------------------------------------------------------


def list_plan(after: str | None, workers: int) -> tuple[int, list[dict[str, Any]]]:
    """How ``GET /sessions?after=`` is asked of each worker: the worker to start from and, per
    worker, the query (its ``limit`` None: as the request's; ``after`` only for the first).
    Workers before the first are asked only for their ``total``."""
    owner = owner_of(after) if after else None
    # An unmarked cursor goes to worker 0, whose store answers 404 for it.
    first = owner if owner is not None and owner < workers else 0
    queries: list[dict[str, Any]] = []
    for k in range(workers):
        if k < first:
            queries.append({"limit": 1, "after": None})
        else:
            queries.append({"limit": None, "after": after if k == first else None})
    return first, queries


def merge_pages(pages: list[dict[str, Any]], *, first: int, limit: int) -> dict[str, Any]:
    """One ``SessionPage`` (its JSON) from every worker's: worker ``first``'s sessions, then the
    next worker's, ... (oldest first within each worker), at most ``limit``; ``total`` counts
    every worker's; ``next`` is the last one's id when more follow (its mark says which worker
    a next page starts at)."""
    sessions: list[dict[str, Any]] = []
    more = False
    for page in pages[first:]:
        room = limit - len(sessions)
        if room <= 0:
            if page["sessions"]:
                more = True
                break
            continue
        sessions += page["sessions"][:room]
        if len(page["sessions"]) > room or page["next"] is not None:
            more = True
            break
    return {
        "sessions": sessions,
        "total": sum(int(p["total"]) for p in pages),
        "next": sessions[-1]["id"] if more and sessions else None,
    }


def merge_metrics(texts: Mapping[int, str | None]) -> bytes:
    """Every worker's Prometheus exposition as one, each sample labelled ``worker="K"`` (sum
    over it for the gateway's totals), plus ``corral_gateway_worker_up`` per worker (0: its
    metrics could not be read)."""
    from prometheus_client import generate_latest
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import Collector, CollectorRegistry

    families: dict[str, Metric] = {}
    up = GaugeMetricFamily(
        "corral_gateway_worker_up", "Whether the gateway worker answered", labels=["worker"]
    )
    for worker, text in sorted(texts.items()):
        up.add_metric([str(worker)], 0.0 if text is None else 1.0)
        for family in text_string_to_metric_families(text or ""):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "worker": str(worker)}, s.value, s.timestamp)

    class _Merged(Collector):
        def collect(self) -> Iterable[Metric]:
            yield up
            yield from families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


# -- the router ----------------------------------------------------------------------------------


class _Unreachable(Exception):
    """A worker's Unix socket could not be reached (it is not running)."""


class WorkerRouter:
    """The ASGI app of worker ``index`` of ``workers``: ``app`` (the gateway) for what this
    worker serves, forwarding to the owner's Unix socket (``socket_dir/worker-K.sock``) for
    what another one does (see the module docstring). ``secret`` marks forwarded requests;
    one without it (or with a wrong one) is routed as any other."""

    def __init__(
        self, app: ASGIApp, *, index: int, workers: int, socket_dir: Path, secret: str
    ) -> None:
        self.app = app
        self.index = index
        self.workers = workers
        self.socket_dir = Path(socket_dir)
        self._secret = secret.encode()
        self._index_header = str(index).encode()
        self._clients: dict[int, Any] = {}  # worker -> aiohttp.ClientSession, made on first use

    def socket_path(self, worker: int) -> Path:
        return worker_socket(self.socket_dir, worker)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._closing_on_shutdown(receive), send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if self._forwarded(headers):
            await self.app(scope, receive, send)
            return
        chosen = route(scope["method"], scope["path"], headers, me=self.index, workers=self.workers)
        if chosen.where == "here":
            await self.app(scope, receive, send)
        elif chosen.where == "owner":
            assert chosen.worker is not None
            await self._forward(chosen.worker, scope, receive, send)
        elif chosen.where == "list":
            await self._list(scope, send)
        elif chosen.where == "health":
            await self._health(scope, send)
        else:
            await self._metrics(scope, send)

    def _forwarded(self, headers: list[tuple[bytes, bytes]]) -> bool:
        marker = FORWARDED_HEADER.encode()
        for name, value in headers:
            if name == marker:
                return hmac.compare_digest(value, self._secret)
        return False

    def _closing_on_shutdown(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                for client in self._clients.values():
                    await client.close()
                self._clients.clear()
            return message

        return wrapped

    def _client(self, worker: int) -> Any:
        import aiohttp

        client = self._clients.get(worker)
        if client is None or client.closed:
            # aiohttp rather than httpx: measured ~3-10x the requests/s over a Unix socket
            # (docs/benchmarks.md, gateway workers). No pool limit: the callers bound it.
            connector = aiohttp.UnixConnector(
                path=str(self.socket_path(worker)), limit=0, keepalive_timeout=30.0
            )
            client = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
                trust_env=False,
                skip_auto_headers=_NO_AUTO_HEADERS,
            )
            self._clients[worker] = client
        return client

    def _out_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
        marker = FORWARDED_HEADER.encode()
        out = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in headers
            if name not in _REQUEST_DROPPED and name != marker
        ]
        out.append((FORWARDED_HEADER, self._secret.decode()))
        return out

    async def _open(
        self,
        worker: int,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        data: Any = None,
    ) -> Any:
        """The owner's answer (an aiohttp response, body not read); :class:`_Unreachable`
        when nothing listens on its socket."""
        import aiohttp
        from multidict import CIMultiDict

        try:
            return await self._client(worker).request(
                method,
                "http://worker" + target,
                headers=CIMultiDict(headers),
                data=data,
                allow_redirects=False,
            )
        except (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError) as exc:
            raise _Unreachable(str(exc)) from exc

    async def _forward(self, worker: int, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the request to worker ``worker`` and its answer back, as it comes."""
        import aiohttp

        first = await receive()
        if first["type"] == "http.disconnect":
            return
        data: Any = first.get("body", b"")
        body_read = [not first.get("more_body")]
        if not body_read[0]:
            head = data

            async def rest() -> Any:
                yield head
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ConnectionResetError("the client went away mid-body")
                    yield message.get("body", b"")
                    if not message.get("more_body"):
                        body_read[0] = True
                        return

            data = rest()
        target = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string") or b""
        target = target.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        # The client going away must reach the owner (it aborts the engine's work and records
        # nothing): watch for it while the owner works on the answer and while it streams, and
        # drop the owner's connection when it comes. (Not while the body is still being sent:
        # an owner that answered early, e.g. 413, reads no more of it, and receive() is the
        # body's until then.)
        gone = asyncio.ensure_future(
            _disconnected(receive) if body_read[0] else asyncio.Event().wait()
        )
        opening = asyncio.ensure_future(
            self._open(worker, scope["method"], target, self._out_headers(scope["headers"]), data)
        )
        try:
            await asyncio.wait({gone, opening}, return_when=asyncio.FIRST_COMPLETED)
            if not opening.done():  # the client left before the owner answered
                opening.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await opening
                return
            answer = opening.result()
        except _Unreachable:
            gone.cancel()
            await _send_json(send, 503, _unavailable_body(worker, scope))
            return
        except (aiohttp.ClientError, ConnectionResetError) as exc:
            gone.cancel()
            log.warning(
                "forwarding %s %s to worker %d failed: %s", scope["method"], target, worker, exc
            )
            await _send_json(send, 503, _unavailable_body(worker, scope))
            return
        except BaseException:
            gone.cancel()
            raise
        relay = asyncio.ensure_future(self._relay(answer, send))
        try:
            done, _ = await asyncio.wait({gone, relay}, return_when=asyncio.FIRST_COMPLETED)
            if relay not in done:
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await relay
            else:
                relay.result()
        finally:
            gone.cancel()
            if relay.cancelled():
                answer.close()  # the owner sees its client go
            else:
                answer.release()

    async def _relay(self, answer: Any, send: Send) -> None:
        import aiohttp

        headers = [
            (name.lower(), value)
            for name, value in answer.raw_headers
            if name.lower() not in _RESPONSE_DROPPED
        ]
        # Which worker took the connection and forwarded it (the owner is in the session id).
        headers.append((FORWARDED_BY_HEADER, self._index_header))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        try:
            async for chunk in answer.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except aiohttp.ClientError as exc:
            # The owner died mid-answer: the response is left incomplete (the connection is
            # dropped), never ended as if it were whole.
            log.warning("worker's answer was cut off: %s", exc)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _ask_all(
        self, scope: Scope, path: str, queries: list[str] | None = None
    ) -> list[tuple[int, bytes] | None]:
        """``GET path`` (``queries[k]`` for worker ``k``) of every worker, this one too, with
        the request's headers: each (status, body), None for a worker not running."""
        headers = self._out_headers(scope["headers"])

        async def one(k: int) -> tuple[int, bytes] | None:
            import aiohttp

            target = path + (queries[k] if queries else "")
            try:
                answer = await self._open(k, "GET", target, headers)
            except (_Unreachable, aiohttp.ClientError):
                return None
            try:
                return answer.status, await answer.read()
            except aiohttp.ClientError:
                return None
            finally:
                answer.release()

        return list(await asyncio.gather(*(one(k) for k in range(self.workers))))

    async def _list(self, scope: Scope, send: Send) -> None:
        from urllib.parse import parse_qs, quote

        params = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
        after = (params.get("after") or [""])[0] or None
        raw_limit = (params.get("limit") or [None])[0]
        first, plan = list_plan(after, self.workers)
        queries = []
        for q in plan:
            limit = q["limit"] if q["limit"] is not None else raw_limit
            parts = [f"limit={quote(str(limit), safe='')}"] if limit is not None else []
            if q["after"] is not None:
                parts.append(f"after={quote(q['after'], safe='')}")
            queries.append("?" + "&".join(parts) if parts else "")
        answers = await self._ask_all(scope, "/sessions", queries)
        pages = []
        for k, answer in enumerate(answers):
            if answer is None:
                await _send_json(send, 503, _unavailable_body(k, scope, "the session list"))
                return
            status, body = answer
            if status != 200:  # the worker's own refusal (401, 400, 404): answered as it is
                await _send_raw(send, status, body)
                return
            pages.append(json.loads(body))
        from corral.gateway.app import LIST_LIMIT

        # Every worker accepted the limit (it answered 200): an integer in range.
        limit = LIST_LIMIT if raw_limit is None else int(raw_limit)
        await _send_json(send, 200, merge_pages(pages, first=first, limit=limit))

    async def _health(self, scope: Scope, send: Send) -> None:
        answers = await self._ask_all(scope, "/health")
        states: list[dict[str, Any]] = []
        engine = True
        for k, answer in enumerate(answers):
            if answer is None:
                states.append({"worker": k, "up": False})
                continue
            status, body = answer
            try:
                engine_ok = bool(json.loads(body).get("engine"))
            except (ValueError, AttributeError):
                engine_ok = False
            engine = engine and engine_ok
            states.append({"worker": k, "up": True, "status": status})
        ok = engine and all(s["up"] and s["status"] == 200 for s in states)
        health = {"status": "ok" if ok else "degraded", "engine": engine, "workers": states}
        await _send_json(send, 200 if ok else 503, health)

    async def _metrics(self, scope: Scope, send: Send) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST

        answers = await self._ask_all(scope, "/metrics")
        texts = {
            k: (a[1].decode() if a is not None and a[0] == 200 else None)
            for k, a in enumerate(answers)
        }
        body = merge_metrics(texts)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _unavailable_body(worker: int, scope: Scope, what: str = "this session") -> dict[str, Any]:
    """The 503 for a worker that is not running, in the shape the request speaks (the
    gateway's error table, as every other gateway error)."""
    error = GatewayError(
        "worker_unavailable",
        f"gateway worker {worker}, which holds {what}, is not running (it is being "
        "restarted); retry shortly",
        code="worker_unavailable",
    )
    return error.anthropic_body() if speaks_anthropic(scope) else error.openai_body()


async def _send_json(send: Send, status: int, body: Any) -> None:
    await _send_raw(send, status, json.dumps(body).encode())


async def _send_raw(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# -- journal folders -----------------------------------------------------------------------------


def worker_socket(socket_dir: Path, worker: int) -> Path:
    return Path(socket_dir) / f"worker-{worker}.sock"


def worker_journal(journal_dir: Path, worker: int, workers: int) -> Path:
    """Worker ``worker``'s journal folder: ``journal_dir`` itself for a one-process gateway,
    else ``journal_dir/worker-K``."""
    return Path(journal_dir) if workers == 1 else Path(journal_dir) / f"worker-{worker}"


class JournalLayoutError(ValueError):
    """The journal folder was written by a gateway with another number of workers."""


def claim_journal(journal_dir: Path, workers: int) -> None:
    """Check that ``journal_dir`` was written by a gateway of ``workers`` workers (a session
    lives in the journal of the worker its id names, so another count would lose or mix them),
    and mark it so when it is new. :class:`JournalLayoutError` naming both counts when not."""
    journal_dir = Path(journal_dir)
    marker = journal_dir / JOURNAL_MARKER
    try:
        written = int(json.loads(marker.read_text())["workers"])
    except FileNotFoundError:
        written = None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise JournalLayoutError(f"cannot read {marker}: {exc}") from None
    # A journal from before the marker existed was a one-process gateway's.
    old_journal = journal_dir.is_dir() and any(
        p.name.startswith("segment-") for p in journal_dir.iterdir()
    )
    if written is None and old_journal:
        written = 1
    if written is not None and written != workers:
        raise JournalLayoutError(
            f"the journal {journal_dir} was written by a gateway with --workers {written}; "
            f"start it with --workers {written} (each worker's sessions are in its own "
            "journal), or give another --journal folder"
        )
    if not marker.exists():
        journal_dir.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"workers": workers}) + "\n")
        os.replace(tmp, marker)


# -- the worker process --------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is started with (in :data:`SPEC_VARIABLE`, as JSON): its place,
    the inherited descriptors, and what :func:`~corral.gateway.server.create_gateway` gets
    (``options``: its keywords, JSON-ready; ``journal_dir`` and ``client_template_kwargs`` as
    a string and a list)."""

    index: int
    workers: int
    listen_fd: int
    parent_fd: int
    host: str
    port: int
    socket_dir: str
    secret: str
    engine_url: str
    model: str
    options: dict[str, Any] = field(default_factory=dict)
    admin_token: str | None = None
    engine_token: str | None = None
    limits: dict[str, Any] = field(default_factory=dict)
    log_level: str = "info"
    access_log: bool = False

    def for_worker(self, index: int) -> WorkerSpec:
        return dataclasses.replace(self, index=index)

    def to_env(self) -> str:
        return base64.b64encode(json.dumps(dataclasses.asdict(self)).encode()).decode()

    @classmethod
    def from_env(cls, value: str) -> WorkerSpec:
        return cls(**json.loads(base64.b64decode(value)))

    def gateway_options(self) -> dict[str, Any]:
        """The keywords of ``create_gateway`` for this worker (after the engine and model)."""
        options = dict(self.options)
        if "client_template_kwargs" in options:
            options["client_template_kwargs"] = frozenset(options["client_template_kwargs"])
        if options.get("journal_dir") is not None:
            options["journal_dir"] = worker_journal(
                Path(options["journal_dir"]), self.index, self.workers
            )
        options["session_id_prefix"] = worker_prefix(self.index)
        return options


def json_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``create_gateway`` keywords as :class:`WorkerSpec` carries them."""
    out = dict(options)
    if "client_template_kwargs" in out:
        out["client_template_kwargs"] = sorted(out["client_template_kwargs"])
    if out.get("journal_dir") is not None:
        out["journal_dir"] = str(out["journal_dir"])
    return out


def _watch_parent(fd: int) -> None:
    """SIGTERM this process once the parent is gone (its end of the pipe closed)."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _unix_listener(path: Path) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a socket file left by this worker's previous life
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.setblocking(False)
    return sock


def worker_main(spec: WorkerSpec) -> None:
    """Serve worker ``spec.index``: the gateway on the inherited TCP socket and on its own
    Unix socket, until SIGTERM (or the parent's end)."""
    from corral.gateway.server import create_gateway
    from corral.serving import serve_sockets_forever
    from corral.transport import TransportLimits

    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[worker {spec.index}]: %(message)s",
    )
    _watch_parent(spec.parent_fd)
    app = create_gateway(
        spec.engine_url,
        spec.model,
        admin_token=spec.admin_token,
        engine_token=spec.engine_token,
        **spec.gateway_options(),
    )
    router = WorkerRouter(
        app,
        index=spec.index,
        workers=spec.workers,
        socket_dir=Path(spec.socket_dir),
        secret=spec.secret,
    )
    tcp = socket.socket(fileno=spec.listen_fd)
    unix = _unix_listener(worker_socket(Path(spec.socket_dir), spec.index))
    try:
        serve_sockets_forever(
            router,
            [tcp, unix],
            address=(spec.host, spec.port),
            limits=TransportLimits(**spec.limits),
            log_level=spec.log_level,
            access_log=spec.access_log,
        )
    except KeyboardInterrupt:
        pass
    finally:
        unix.close()


def main() -> int:
    spec = WorkerSpec.from_env(os.environ.pop(SPEC_VARIABLE))
    worker_main(spec)
    return 0


# -- the parent ----------------------------------------------------------------------------------


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    quick_exits: int = 0
    restart_at: float = 0.0


class Supervisor:
    """Starts the workers of ``spec`` (its ``index`` is ignored), restarts one that exits, and
    stops them all on :meth:`stop`. ``command``: how a worker process is started."""

    def __init__(self, spec: WorkerSpec, command: list[str] | None = None) -> None:
        self.spec = spec
        self.command = command or [sys.executable, "-m", "corral.gateway.workers"]
        self.workers = [_Worker(k) for k in range(spec.workers)]

    def start(self, worker: _Worker) -> None:
        env = {**os.environ, SPEC_VARIABLE: self.spec.for_worker(worker.index).to_env()}
        worker.process = subprocess.Popen(
            self.command,
            env=env,
            pass_fds=(self.spec.listen_fd, self.spec.parent_fd),
            stdin=subprocess.DEVNULL,
            # Its own session: a terminal's Ctrl-C reaches the parent, which stops the workers.
            start_new_session=True,
        )
        worker.started_at = time.monotonic()
        log.info("gateway worker %d started (pid %d)", worker.index, worker.process.pid)

    def start_all(self) -> None:
        for worker in self.workers:
            self.start(worker)

    def check(self, now: float) -> float | None:
        """Restart the workers that exited (after a pause for one that keeps dying at once);
        the seconds until the next pending restart, None when none is pending."""
        wait: float | None = None
        for worker in self.workers:
            process = worker.process
            if process is not None and process.poll() is not None:
                lived = now - worker.started_at
                worker.quick_exits = worker.quick_exits + 1 if lived < _QUICK_EXIT_S else 0
                pause = min(_MAX_RESTART_PAUSE_S, 0.5 * 2 ** max(0, worker.quick_exits - 1))
                pause = pause if worker.quick_exits else 0.0
                log.warning(
                    "gateway worker %d (pid %d) exited with status %s after %.1f s; "
                    "restarting it%s",
                    worker.index,
                    process.pid,
                    process.returncode,
                    lived,
                    f" in {pause:g} s" if pause else "",
                )
                worker.process = None
                worker.restart_at = now + pause
            if worker.process is None:
                if now >= worker.restart_at:
                    self.start(worker)
                else:
                    left = worker.restart_at - now
                    wait = left if wait is None else min(wait, left)
        return wait

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM every worker, wait for them (SIGKILL past ``timeout_s``), log each exit."""
        live = [w for w in self.workers if w.process is not None and w.process.poll() is None]
        for worker in live:
            assert worker.process is not None
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            process = worker.process
            if process is None:
                continue
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.info(
                "gateway worker %d (pid %d) exited with status %s",
                worker.index,
                process.pid,
                process.returncode,
            )
            worker.process = None


@contextlib.contextmanager
def _signals_to(wake_fd: int) -> Iterator[dict[str, int | None]]:
    """SIGTERM / SIGINT noted (and SIGCHLD), each waking ``wake_fd``'s reader."""
    got: dict[str, int | None] = {"stop": None}

    def stop(signum: int, frame: Any) -> None:
        got["stop"] = signum

    def child(signum: int, frame: Any) -> None:
        pass

    previous = {
        s: signal.signal(s, h)
        for s, h in ((signal.SIGTERM, stop), (signal.SIGINT, stop), (signal.SIGCHLD, child))
    }
    old_wake = signal.set_wakeup_fd(wake_fd)
    try:
        yield got
    finally:
        signal.set_wakeup_fd(old_wake)
        for s, h in previous.items():
            signal.signal(s, h)


def run_workers(spec: WorkerSpec, listener: socket.socket, command: list[str] | None = None) -> int:
    """Run the gateway as ``spec.workers`` worker processes on ``listener`` (bound, from
    :func:`~corral.serving.bind_socket`) until SIGTERM (returns 0) or SIGINT (raises
    ``KeyboardInterrupt``), supervising them. ``spec``'s descriptors and socket folder are
    filled here."""
    socket_dir = tempfile.mkdtemp(prefix="corral-gateway-")  # mode 0700
    os.chmod(socket_dir, 0o700)
    parent_read, parent_write = os.pipe()  # the workers' read end sees EOF once this process ends
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    spec = dataclasses.replace(
        spec,
        listen_fd=listener.fileno(),
        parent_fd=parent_read,
        socket_dir=socket_dir,
        secret=spec.secret or secrets.token_urlsafe(24),
    )
    supervisor = Supervisor(spec, command)
    stopped: int | None = None
    try:
        with _signals_to(wake_write) as got:
            supervisor.start_all()
            while got["stop"] is None:
                wait = supervisor.check(time.monotonic())
                if got["stop"] is not None:
                    break
                # Woken by any signal (a worker's exit: SIGCHLD), or when a paused restart is due.
                with contextlib.suppress(InterruptedError):
                    ready, _, _ = select.select([wake_read], [], [], wait)
                    if ready:
                        os.read(wake_read, 512)
            stopped = got["stop"]
            log.info("stopping the gateway's %d workers", spec.workers)
            supervisor.stop()
    finally:
        supervisor.stop(timeout_s=5.0)
        for fd in (parent_read, parent_write, wake_read, wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(socket_dir, ignore_errors=True)
    if stopped == signal.SIGINT:
        raise KeyboardInterrupt
    return 0


if __name__ == "__main__":
    sys.exit(main())
