"""Bounded HTTP/WebSocket transport for corral's servers: no idle or slow socket is held for ever.

uvicorn (httptools underneath) bounds a connection only between requests (its keep-alive
timeout). Before a connection's first request, while a request head trickles in a byte at a
time, or while a request body never finishes, it waits for as long as the peer likes, and the
request head has no size limit. Every such socket holds a file descriptor, and once the
process runs out of them ``accept`` fails and ``GET /health`` fails with it: measured with
``RLIMIT_NOFILE`` 256, 300 idle, slowloris or half-body sockets (1100 with 1024) left every
new client's request unanswered while uvicorn held them as long as the prober waited.
uvicorn's ``limit_concurrency`` does not help: it counts idle sockets too, so the same attack
turns every real request into a 503.

:class:`TransportLimits` holds the bounds, each default defined here once;
:func:`hardened_config` builds a ``uvicorn.Config`` that enforces them with
:class:`GuardedHttpToolsProtocol`, a small subclass of uvicorn's httptools protocol, and one
:class:`ConnectionGuard` per server. The bounds:

- a request head (request line and headers) must be complete ``head_timeout_s`` after the
  connection opens, or after the first byte of a later request on a kept-alive connection;
  else the socket is closed (with a 408 if part of a head had arrived);
- a request head larger than ``max_head_bytes`` gets a 431 and a close;
- a request body must be complete ``body_timeout_s`` after its head; else 408 (or a bare
  close once the app has started its response);
- at most ``max_pending`` connections may have an incomplete request (head or body not yet
  all in: a new connection counts from its first moment, a kept-alive one from the first
  byte of its next request); beyond that the *oldest* of them is dropped. Dropping the
  newest would let whoever holds the cap lock every real client out; a real client sends
  its request within a round trip or two of connecting, so to evict it an attacker must open
  ``max_pending`` sockets inside that window, while the attacker's own sockets are the old
  ones that go first;
- at most ``max_connections`` other connections (busy, idle, WebSocket): a request
  completing its head beyond that first closes the longest-idle kept-alive connection
  (closing an idle keep-alive connection is always allowed in HTTP/1.1), and if there is
  none it is answered ``503`` with ``Retry-After`` and the connection closed: a clear
  answer, never a stall. Together the two caps bound the descriptors sockets can take
  (:func:`fd_budget` fits them to ``RLIMIT_NOFILE``);
- a WebSocket message larger than ``ws_max_size`` closes the socket with 1009 (uvicorn);
  WebSocket pings every ``ws_ping_interval`` s drop a peer that stops answering (uvicorn).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
from collections import OrderedDict
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

# How long a server keeps an idle keep-alive connection: longer than its clients keep one
# (httpx: 5 s). With equal timeouts a client can send a request on a connection the server is
# closing that instant, and the request fails with a ReadError (seen at 256 concurrent rollouts
# through the gateway); this way the client always closes an idle connection first.
KEEP_ALIVE_S = 75


@dataclasses.dataclass(frozen=True)
class TransportLimits:
    """The bounds one server's transport enforces (see the module docstring for each).

    Defaults: a head within 10 s (a real client sends its whole head in one write, well
    inside a second even across a continent; 10 s leaves room for a stalled network while
    a slowloris socket lives 10 s, not for ever); a body within 60 s of its head (env and
    gateway request bodies are at most a few MiB; 60 s is about 0.5 Mbit/s for 4 MiB);
    64 KiB of head (twice nginx's default of 4 x 8 KiB header buffers; corral's clients send
    well under 4 KiB); 1024 connections waiting for a head (twice the largest burst seen, 512
    episodes connecting at once in bench/envs.py: a legitimate burst must stay under the cap,
    since beyond it the oldest waiting connection is dropped); 4096 connections in all (eight
    times that burst; 10240 descriptors, see :func:`fd_budget`); 4 MiB per WebSocket message
    (an env message carries a model's tool call, bounded by its context, which is well under
    1 MiB of text).
    """

    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: int = KEEP_ALIVE_S
    max_head_bytes: int = 64 * 1024
    max_pending: int = 1024
    max_connections: int = 4096
    retry_after_s: int = 1
    ws_max_size: int = 4 * 1024 * 1024
    ws_ping_interval: float | None = 20.0
    ws_ping_timeout: float | None = 20.0

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TransportLimits.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_head_bytes", "max_pending", "max_connections", "ws_max_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TransportLimits.{name} must be an integer >= 1, got {value!r}")
        if self.retry_after_s < 0:
            raise ValueError(
                f"TransportLimits.retry_after_s must be >= 0, got {self.retry_after_s!r}"
            )


def fd_budget(limits: TransportLimits) -> TransportLimits:
    """``limits`` made to fit this process's file-descriptor limit (``RLIMIT_NOFILE``).

    Connections (up to ``max_pending + max_connections``) may use half the descriptors; the
    other half stays for sandboxes, subprocess pipes and files. Past the fd limit ``accept``
    fails and every new client fails with it, which is what the caps exist to prevent. When
    the soft limit is too low this first raises it towards the hard limit (the process's own
    limit to raise; uvicorn does not); if that is still short, both caps are lowered to fit,
    ``max_pending`` to at most a quarter of the budget, with a warning.
    """
    need = 2 * (limits.max_pending + limits.max_connections)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the soft limit we have and fit the caps to it
    if soft == resource.RLIM_INFINITY or soft >= need:
        return limits
    budget = soft // 2
    pending = max(1, min(limits.max_pending, budget // 4))
    fitted = dataclasses.replace(
        limits, max_pending=pending, max_connections=max(1, budget - pending)
    )
    logger.warning(
        "RLIMIT_NOFILE %d is too low for %d incomplete + %d other connections; using %d + %d "
        "(raise the hard limit, e.g. `ulimit -Hn`, to allow more)",
        soft,
        limits.max_pending,
        limits.max_connections,
        fitted.max_pending,
        fitted.max_connections,
    )
    return fitted


class ConnectionGuard:
    """One server's connections with an incomplete request, and those idle between requests.

    Both are kept in arrival order so that the oldest is the one dropped. Plain bookkeeping:
    the protocol decides when a connection enters or leaves either set.
    """

    def __init__(self, limits: TransportLimits) -> None:
        self.limits = limits
        self.over_capacity = _over_capacity_app(limits.retry_after_s)
        self.pending: OrderedDict[GuardedHttpToolsProtocol, None] = OrderedDict()
        self.idle: OrderedDict[GuardedHttpToolsProtocol, None] = OrderedDict()

    def wait_for_head(self, conn: GuardedHttpToolsProtocol) -> None:
        """``conn`` starts a request; drop the oldest incomplete ones beyond the cap."""
        self.idle.pop(conn, None)
        self.pending[conn] = None
        while len(self.pending) > self.limits.max_pending:
            oldest, _ = self.pending.popitem(last=False)
            oldest.drop("too many connections with an incomplete request")

    def go_idle(self, conn: GuardedHttpToolsProtocol) -> None:
        self.pending.pop(conn, None)
        self.idle[conn] = None

    def busy(self, conn: GuardedHttpToolsProtocol) -> None:
        """``conn``'s request is complete and the app is answering it: in neither set."""
        self.forget(conn)

    def forget(self, conn: GuardedHttpToolsProtocol) -> None:
        self.pending.pop(conn, None)
        self.idle.pop(conn, None)

    def evict_idle(self) -> bool:
        """Close the longest-idle kept-alive connection; False when there is none."""
        if not self.idle:
            return False
        oldest, _ = self.idle.popitem(last=False)
        oldest.drop("connection limit reached; closing an idle keep-alive connection")
        return True


def _raw_response(status: int, reason: str, text: str, *extra: tuple[str, str]) -> bytes:
    body = text.encode()
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: text/plain; charset=utf-8"]
    lines += [f"{name}: {value}" for name, value in extra]
    lines += [f"content-length: {len(body)}", "connection: close", "", ""]
    return "\r\n".join(lines).encode("ascii") + body


AT_CAPACITY = "server at its connection limit; retry shortly"


def _over_capacity_app(retry_after_s: int) -> Any:
    """The ASGI app that answers a request beyond ``max_connections``: 503 + Retry-After."""
    body = AT_CAPACITY.encode()
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(retry_after_s).encode()),
        (b"connection", b"close"),
    ]

    async def over_capacity(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return over_capacity


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus a head deadline, a body deadline and the caps.

    uvicorn creates one per connection; ``guard`` is the class attribute that
    :func:`hardened_config` sets on a per-server subclass (uvicorn instantiates the protocol
    class itself, so this is how the server's guard reaches each connection without a
    global). A connection is *incomplete* (in the guard's ``pending``, dropped oldest-first
    beyond ``max_pending``) from the moment it opens, or the first byte of its next request,
    until that request's head and body have both arrived: reading a head (head deadline) ->
    reading a body (body deadline) -> busy (the app answers) -> idle (kept alive, uvicorn's
    keep-alive timeout) -> reading a head ...
    """

    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = self.guard.limits
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._waiting_head = False
        self._body_done = False
        self._head_bytes = 0
        self._head_tail = b""  # the head's last bytes so far: its end may span two reads
        self._head_begun = False  # a byte other than CR/LF seen: blank lines before it skipped
        self._dropped = False

    # -- state transitions -------------------------------------------------------------------

    def _start_request(self) -> None:
        self._waiting_head = True
        self._body_done = False
        self._head_bytes = 0
        self._head_tail = b""
        self._head_begun = False
        self._head_timer = self._cancel(self._head_timer)

        self._head_timer = self.loop.call_later(self._limits.head_timeout_s, self._head_expired)
        self.guard.wait_for_head(self)

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> asyncio.TimerHandle | None:
        """Cancel ``timer`` if set; returns None, to clear the attribute that held it."""
        if timer is not None:
            timer.cancel()
        return None

    def drop(self, why: str, response: bytes = b"") -> None:
        """Close this connection now, writing ``response`` first if given (idempotent)."""
        if self._dropped or self.transport.is_closing():
            return
        self._dropped = True
        # debug, not info: under an attack this runs once per hostile socket.
        logger.debug("dropping connection from %s: %s", self.client, why)
        if response:
            self.transport.write(response)
        self.transport.close()

    def _head_expired(self) -> None:
        self._head_timer = None
        # Nothing received: an idle socket; a close says all there is to say. Part of a head:
        # tell the peer why, as nginx does.
        response = b""
        if self._head_bytes:
            response = _raw_response(408, "Request Timeout", "request head not completed in time")
        self.drop(f"no complete request head within {self._limits.head_timeout_s} s", response)

    def _body_expired(self) -> None:
        self._body_timer = None
        response = b""
        if self.cycle is not None and not self.cycle.response_started:
            response = _raw_response(408, "Request Timeout", "request body not completed in time")
        self.drop(f"request body not completed within {self._limits.body_timeout_s} s", response)

    # -- uvicorn hooks -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer = self._cancel(self._head_timer)
        self._body_timer = self._cancel(self._body_timer)
        self.guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._dropped:
            return
        if self._body_done and self.cycle is not None and self.cycle.response_complete:
            # The first byte of a new request on a kept-alive connection: from here on the
            # head deadline applies, not the keep-alive timeout (uvicorn cancels that on any
            # byte, so without this a byte every 70 s would hold the socket for ever).
            self._start_request()
        if self._waiting_head:
            # Counted before parsing, up to the blank line that ends the head, so the read that
            # completes a head counts too and an oversized head is never parsed; bytes after
            # it in the same read are body.
            self._head_bytes += self._head_part(data)
            if self._head_bytes > self._limits.max_head_bytes:
                self.drop(
                    f"request head over {self._limits.max_head_bytes} bytes",
                    _raw_response(431, "Request Header Fields Too Large", "request head too large"),
                )
                return
        super().data_received(data)

    def _head_part(self, data: bytes) -> int:
        """How many of ``data``'s bytes belong to the head still being read: up to the first
        blank line (CRLF CRLF, or the bare LF LF that lenient parsers take), else all."""
        carried = len(self._head_tail)
        seen = self._head_tail + data
        start = 0
        if not self._head_begun:
            # Blank lines before a request line are skipped by the parser, not a head's end.
            start = len(seen) - len(seen.lstrip(b"\r\n"))
            self._head_begun = start < len(seen)
        marks = (b"\r\n\r\n", b"\n\n")
        ends = [at + len(mark) for mark in marks if (at := seen.find(mark, start)) >= 0]
        self._head_tail = seen[-3:]
        return max(0, min(ends) - carried) if ends else len(data)

    def on_headers_complete(self) -> None:
        self._waiting_head = False
        self._head_timer = self._cancel(self._head_timer)
        # Incomplete requests are capped by max_pending on their own (this one among them);
        # the total cap counts the rest: busy, idle and WebSocket connections. Counting the
        # incomplete ones here would let idle sockets turn every real request into a 503.
        complete = len(self.connections) - len(self.guard.pending)
        if complete >= self._limits.max_connections and not self.guard.evict_idle():
            logger.debug("connection limit %d reached: answering 503", self._limits.max_connections)
            if self.parser.should_upgrade() and self._should_upgrade():
                self.drop(
                    "connection limit reached",
                    _raw_response(
                        503,
                        "Service Unavailable",
                        AT_CAPACITY,
                        ("retry-after", str(self._limits.retry_after_s)),
                    ),
                )
                return
            # Through uvicorn's own request cycle (rather than a raw write) so the request
            # body is read and the client sees the answer instead of a reset.
            self.app = self.guard.over_capacity
        self._body_timer = self._cancel(self._body_timer)
        self._body_timer = self.loop.call_later(self._limits.body_timeout_s, self._body_expired)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._body_done = True
        self._body_timer = self._cancel(self._body_timer)
        if self.cycle is not None and self.cycle.response_complete:
            # The app answered before the body was all in (e.g. a refusal): the connection
            # is idle from now on, and evictable as such. uvicorn armed its keep-alive timer
            # at the response and cancelled it at the next body byte, so arm it again, or
            # the socket would stay open for ever.
            self.guard.go_idle(self)
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
        else:
            self.guard.busy(self)
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._body_done and not self.transport.is_closing() and not self.pipeline:
            self.guard.go_idle(self)

    def handle_websocket_upgrade(self) -> None:
        if self._dropped:
            return
        # From here the WebSocket protocol owns the socket (uvicorn's ping keepalive and
        # ws_max_size bound it); this connection's timers and bookkeeping end.
        self._body_timer = self._cancel(self._body_timer)
        self.guard.forget(self)
        super().handle_websocket_upgrade()


def hardened_config(app: Any, limits: TransportLimits, **config: Any) -> uvicorn.Config:
    """A ``uvicorn.Config`` for ``app`` that enforces ``limits`` (lowered to fit the fd limit).

    ``config`` is passed to ``uvicorn.Config`` as is, except the settings ``limits`` owns
    (``http``, ``timeout_keep_alive``, ``ws_max_size``, ``ws_ping_interval``,
    ``ws_ping_timeout``, ``limit_concurrency``, ``h11_max_incomplete_event_size``), which
    raise ``TypeError`` if given: one source for each bound.
    """
    owned = {
        "http",
        "timeout_keep_alive",
        "ws_max_size",
        "ws_ping_interval",
        "ws_ping_timeout",
        "limit_concurrency",
        "h11_max_incomplete_event_size",
    }
    clash = sorted(owned & config.keys())
    if clash:
        raise TypeError(f"set {', '.join(clash)} through TransportLimits, not as uvicorn settings")
    limits = fd_budget(limits)
    guard = ConnectionGuard(limits)
    protocol = type("GuardedProtocol", (GuardedHttpToolsProtocol,), {"guard": guard})
    return uvicorn.Config(
        app,
        http=protocol,
        timeout_keep_alive=limits.keep_alive_s,
        ws_max_size=limits.ws_max_size,
        ws_ping_interval=limits.ws_ping_interval,
        ws_ping_timeout=limits.ws_ping_timeout,
        **config,
    )
