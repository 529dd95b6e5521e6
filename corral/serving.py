"""Start an ASGI app with uvicorn: the one way corral's servers are started.

- :func:`serve_forever`: in the foreground until SIGINT / SIGTERM (``corral serve``,
  ``corral engine``, ``corral gateway``, ``corral view``);
- :func:`serve_in_thread`: in a background thread while a block lasts (in-process stacks,
  tests, demos, benchmarks);
- :func:`serve_in_loop`: in the caller's running event loop while an ``async with`` block
  lasts (many at once in one process, e.g. one MCP server per episode).

All three run with corral's transport limits (:mod:`corral.transport`): no idle or slow
socket is held for ever, whichever app is served. All three bind the listening socket
themselves before uvicorn starts (uvicorn only listens on it once the app's startup is done),
so a port that cannot be bound is an exception here (:class:`BindError`) rather than
uvicorn's log line and ``sys.exit(1)``, and port 0 picks a free port with no race.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn

from corral.transport import KEEP_ALIVE_S, TransportLimits, hardened_config

__all__ = [
    "KEEP_ALIVE_S",
    "BindError",
    "bind_socket",
    "free_port",
    "serve_forever",
    "serve_in_loop",
    "serve_in_thread",
    "serve_sockets_forever",
]

# uvicorn's own logger: the "Uvicorn running on ..." line goes where uvicorn's lines go.
_uvicorn_logger = logging.getLogger("uvicorn.error")

# Servers embedded in a process that does other work (serve_in_thread, serve_in_loop): quiet,
# and a short graceful shutdown so that leaving the block does not hang on a stuck request.
EMBEDDED_LOG_LEVEL = "warning"
EMBEDDED_GRACEFUL_SHUTDOWN_S = 2


class BindError(OSError):
    """The server's address could not be bound (taken, not an address of this host, no
    permission). ``str()`` is one line naming the address; ``errno`` is the bind's."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the usual race applies: to serve on a free port,
    give port 0 to :func:`serve_in_thread` or :func:`serve_in_loop` instead)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bind_error(host: str, port: int, exc: OSError) -> BindError:
    error = BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    error.errno = exc.errno
    return error


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)``, not yet listening (asyncio listens on it when
    uvicorn starts serving, after the app's startup: until then a client is refused, as with
    uvicorn binding itself). Raises :class:`BindError`."""
    # As uvicorn's own Config.bind_socket: IPv6 for an address with a colon, SO_REUSEADDR so
    # a restart is not refused while the previous server's connections sit in TIME_WAIT.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise _bind_error(host, port, exc) from exc
    sock.setblocking(False)
    return sock


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)``, not yet listening, for a server that serves it
    from other processes (``corral gateway --workers``: each worker's uvicorn listens on it
    once its app has started, so until the first one has, a client is refused). Raises
    :class:`BindError`."""
    return _bind(host, port)


def _ignore_signal(signum: int, frame: Any) -> None:
    """A handler that does nothing (see :meth:`_Server.capture_signals`)."""


class _Server(uvicorn.Server):
    """``uvicorn.Server`` on a socket from :func:`_bind`, with corral's hooks.

    - ``on_ready`` is called once startup has finished, whether it succeeded
      (``started``) or not: what a caller waits on, instead of polling.
    - ``on_shutdown`` is awaited before uvicorn's own shutdown (which closes the sockets,
      waits for requests in flight, then runs the lifespan shutdown): e.g. an env server
      closes its episodes' sockets with a reason first, rather than having them cut.
    - ``embedded``: the server lives in a process that does other work. It takes no signals
      (the process's are its host's), and a failed startup leaves ``started`` False for the
      caller to report, rather than uvicorn's ``sys.exit``, which would end the thread or,
      from an asyncio task, the whole event loop.
    - Not embedded, SIGINT / SIGTERM shut it down gracefully. uvicorn re-raises the signal it
      caught once it has shut down; for SIGTERM that would kill the process (exit status
      -15) after a clean shutdown, so SIGTERM ends here and the server returns normally.
      SIGINT is re-raised (``KeyboardInterrupt``), as for any Ctrl-C.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        address: tuple[str, int],
        *,
        embedded: bool,
        on_ready: Callable[[], None] | None = None,
        on_shutdown: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(config)
        self._address = address
        self._embedded = embedded
        self._on_ready = on_ready
        self._on_shutdown = on_shutdown

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self._embedded:
            yield
            return
        if threading.current_thread() is not threading.main_thread():
            # Signals reach only the main thread: uvicorn takes none here, so none is
            # re-raised either; whoever started this thread stops it with should_exit.
            with super().capture_signals():
                yield
            return
        # uvicorn saves this handler, restores it after its shutdown and re-raises the SIGTERM
        # it caught: a no-op here makes the graceful shutdown the end of it.
        previous = signal.signal(signal.SIGTERM, _ignore_signal)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            try:
                await super().startup(sockets=sockets)
            except OSError as exc:
                # listen() refused: another socket bound the same port with SO_REUSEADDR
                # between our bind and the listen.
                raise _bind_error(*self._address, exc) from exc
            except SystemExit:
                if not self._embedded:
                    raise
                self.should_exit = True  # the app's startup failed: do not serve
            if self.started:
                # uvicorn logs this only for a socket it bound itself.
                host, port = self._address
                shown = f"[{host}]" if ":" in host else host
                _uvicorn_logger.info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", shown, port
                )
        finally:
            if self._on_ready is not None:
                self._on_ready()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            if self._on_shutdown is not None:
                await self._on_shutdown()
        finally:
            await super().shutdown(sockets=sockets)


def _config(app: Any, limits: TransportLimits | None, **config: Any) -> uvicorn.Config:
    """Every server's ``uvicorn.Config``: ``config`` with corral's transport limits
    (default ``TransportLimits()``; the settings they own raise ``TypeError`` in
    ``config``)."""
    return hardened_config(app, limits or TransportLimits(), **config)


def serve_forever(
    app: Any,
    *,
    host: str,
    port: int,
    limits: TransportLimits | None = None,
    log_level: str = "info",
    access_log: bool = False,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    timeout_graceful_shutdown: float | None = None,
) -> None:
    """Serve ``app`` on ``host:port`` in the foreground until SIGINT / SIGTERM (blocks).

    ``limits`` bounds the transport (default ``TransportLimits()``, see
    :mod:`corral.transport`). On the signal, ``on_shutdown`` is awaited first, then uvicorn's
    graceful shutdown waits at most ``timeout_graceful_shutdown`` s (None: for as long as it
    takes) for requests in flight before cancelling them, and the app's lifespan shutdown
    runs.

    A SIGTERM shutdown is a clean exit: this returns normally (the process exits 0), where
    a bare ``uvicorn.run`` re-raises the signal (exit status -15). SIGINT raises
    ``KeyboardInterrupt`` once shut down. Off the main thread no signal is taken; the server
    then runs until its process ends.

    Raises :class:`BindError` (an ``OSError``) if the address cannot be bound, before
    anything is served; if the app's startup fails, uvicorn logs why and exits the process
    with status 3 (``SystemExit``).
    """
    sock = _bind(host, port)
    bound = int(sock.getsockname()[1])  # port 0 picks one
    try:
        config = _config(
            app,
            limits,
            host=host,
            port=bound,
            log_level=log_level,
            access_log=access_log,
            timeout_graceful_shutdown=timeout_graceful_shutdown,
        )
        server = _Server(config, (host, bound), embedded=False, on_shutdown=on_shutdown)
        server.run(sockets=[sock])
    finally:
        sock.close()


def serve_sockets_forever(
    app: Any,
    sockets: list[socket.socket],
    *,
    address: tuple[str, int],
    limits: TransportLimits | None = None,
    log_level: str = "info",
    access_log: bool = False,
    timeout_graceful_shutdown: float | None = None,
) -> None:
    """:func:`serve_forever` on sockets bound elsewhere (e.g. a TCP socket inherited from a
    parent process, :func:`bind_socket`, and a Unix socket of this process): each is listened
    on once the app's startup is done. ``address`` is the host and port the log line names.
    The sockets stay the caller's to close."""
    host, port = address
    config = _config(
        app,
        limits,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=timeout_graceful_shutdown,
    )
    _Server(config, address, embedded=False).run(sockets=sockets)


def _embedded_config(
    app: Any, limits: TransportLimits | None, config: dict[str, Any]
) -> uvicorn.Config:
    config.setdefault("log_level", EMBEDDED_LOG_LEVEL)
    config.setdefault("timeout_graceful_shutdown", EMBEDDED_GRACEFUL_SHUTDOWN_S)
    return _config(app, limits, **config)


def _bind_or_fail(host: str, port: int) -> socket.socket:
    try:
        return _bind(host, port)
    except BindError as exc:
        raise RuntimeError(f"the server on {host}:{port} did not start: {exc}") from exc


@contextlib.contextmanager
def serve_in_thread(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    limits: TransportLimits | None = None,
    **config: Any,
) -> Iterator[str]:
    """Serve ``app`` in a background thread until the block exits; yield its base URL.

    ``port`` None (or 0) picks a free one. ``limits`` bounds the transport (default:
    ``TransportLimits()``); other ``config`` goes to ``uvicorn.Config`` (the settings
    ``limits`` owns raise ``TypeError`` there; default log level ``warning``, graceful
    shutdown 2 s).

    Returns once uvicorn listens (waited on with an event, not a sleep); raises
    ``RuntimeError`` if it does not start (the port cannot be bound, the app's startup
    fails). On exit the server shuts down gracefully (lifespan shutdown runs).
    """
    sock = _bind_or_fail(host, port or 0)
    bound = int(sock.getsockname()[1])
    try:
        ready = threading.Event()
        server = _Server(
            _embedded_config(app, limits, {"host": host, "port": bound, **config}),
            (host, bound),
            embedded=True,
            on_ready=ready.set,
        )

        def run() -> None:
            try:
                server.run(sockets=[sock])
            finally:
                ready.set()  # also when it fails before startup (e.g. loading the config)

        thread = threading.Thread(target=run, name=f"uvicorn-{bound}", daemon=True)
        thread.start()
        ready.wait()
        if not server.started:
            thread.join(timeout=5)
            raise RuntimeError(f"the server on {host}:{bound} did not start")
        try:
            yield f"http://{host}:{bound}"
        finally:
            server.should_exit = True
            thread.join(timeout=15)
    finally:
        sock.close()


@contextlib.asynccontextmanager
async def serve_in_loop(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: TransportLimits | None = None,
    **config: Any,
) -> AsyncIterator[str]:
    """Serve ``app`` in this event loop until the block exits; yield its base URL.

    For servers embedded in a process that does other work, many at once if need be: the
    server takes no signals, and ``port`` 0 (the default) has the kernel pick a free port
    when the socket is bound, with no window for another process to take it. ``limits`` and
    ``config`` as for :func:`serve_in_thread`.

    Returns once uvicorn listens (waited on with an event); raises ``RuntimeError`` if it
    does not start (the port cannot be bound, the app's startup fails; the cause is
    chained). On exit the server shuts down gracefully and the port is released; an error
    while shutting down is retrieved, not raised, so that it cannot mask the block's own.
    """
    sock = _bind_or_fail(host, port)
    bound = int(sock.getsockname()[1])
    try:
        ready = asyncio.Event()
        server = _Server(
            _embedded_config(app, limits, {"host": host, "port": bound, **config}),
            (host, bound),
            embedded=True,
            on_ready=ready.set,
        )
        serving = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn-{bound}")
        try:
            waiting = asyncio.create_task(ready.wait())
            await asyncio.wait({serving, waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if not server.started:
                failed = serving.done() and not serving.cancelled() and serving.exception()
                raise RuntimeError(f"the server on {host}:{bound} did not start") from (
                    failed or None
                )
            yield f"http://{host}:{bound}"
        finally:
            server.should_exit = True
            await asyncio.wait({serving})
            if not serving.cancelled():
                serving.exception()  # retrieved: a teardown failure must not mask the block's
    finally:
        sock.close()
