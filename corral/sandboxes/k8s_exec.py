"""The exec stream of the kubernetes backend (:mod:`corral.sandboxes.kubernetes`): one
WebSocket to the API server per command (``v5.channel.k8s.io`` or ``v4.channel.k8s.io``),
read on a thread of its own, and :class:`KubernetesProcess`, a spawned command kept on one.

Frames carry a channel byte (:data:`STDIN`, :data:`STDOUT`, :data:`STDERR`, :data:`ERROR`: the
exit status, :data:`CLOSE`: ``v5`` only, closes a channel) and the payload. Each stream gets a
thread of its own rather than one of the default executor's: a stream lasts as long as its
command, and a few long-running ones must not starve the short API calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import stream as k8s_stream
from websocket import ABNF, WebSocketException

from corral.sandboxes.base import SandboxError, SandboxProcess
from corral.sandboxes.shell import SPAWN_STARTED
from corral.sandboxes.streams import LineBuffer

T = TypeVar("T")

# Channel protocol of the exec stream (k8s.io/apimachinery/pkg/util/remotecommand).
STDIN, STDOUT, STDERR, ERROR, CLOSE = 0, 1, 2, 3, 255
V5 = "v5.channel.k8s.io"
STDIN_CHUNK = 256 * 1024  # stdin frames; a frame is held whole in memory at both ends


def api_error(e: ApiException) -> str:
    """The API server's own message for a failed call, when its body holds one."""
    try:
        message = json.loads(e.body or "").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"{e.status} {message or e.reason or ''}".strip()


def exit_code(status: bytes) -> int:
    """The exit code in an exec stream's status message (channel 3): ``Success`` is 0, a
    ``NonZeroExitCode`` failure carries it as the ``ExitCode`` cause. :class:`SandboxError` for
    any other failure (the command could not be run at all)."""
    try:
        doc = json.loads(status)
    except ValueError as e:
        raise SandboxError(f"unreadable exec status {status[:200]!r}") from e
    if doc.get("status") == "Success":
        return 0
    for cause in (doc.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            try:
                return int(cause.get("message"))
            except (TypeError, ValueError):
                break
    raise SandboxError(f"exec failed: {doc.get('message') or doc}")


class ExecStream:
    """One exec WebSocket. Frames are read on one thread (:meth:`pump`); stdin may be sent from
    another (websocket-client serializes sends, its pong replies included)."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws  # kubernetes.stream.ws_client.WSClient: only its socket is used
        self._sock = ws.sock
        self.v5 = getattr(ws, "subprotocol", None) == V5

    def send_stdin(self, data: bytes) -> None:
        """Send ``data`` on the stdin channel. Raises (websocket/OS errors) once closed."""
        for i in range(0, len(data), STDIN_CHUNK):
            self._sock.send_binary(bytes([STDIN]) + data[i : i + STDIN_CHUNK])

    def close_stdin(self) -> None:
        """Close the command's stdin (``v5`` only: ``v4`` has no way to say so)."""
        if self.v5:
            self._sock.send_binary(bytes([CLOSE, STDIN]))

    def pump(
        self, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None]
    ) -> bytes | None:
        """Deliver frames until the stream ends; return the status message (channel 3), or
        ``None`` when the stream ended without one (aborted, the Pod went away)."""
        status = bytearray()
        while True:
            try:
                opcode, frame = self._sock.recv_data_frame(True)
            except (WebSocketException, OSError, AttributeError):
                break  # closed under us (abort) or by the peer without a close frame
            if opcode == ABNF.OPCODE_CLOSE:
                break
            data = frame.data
            if opcode not in (ABNF.OPCODE_BINARY, ABNF.OPCODE_TEXT) or not data:
                continue
            if isinstance(data, str):
                data = data.encode()
            channel, payload = data[0], bytes(data[1:])
            if channel == STDOUT:
                on_stdout(payload)
            elif channel == STDERR:
                on_stderr(payload)
            elif channel == ERROR:
                status += payload
        return bytes(status) if status else None

    def abort(self) -> None:
        """Wake :meth:`pump` (it returns ``None`` unless the status already came). Never raises.
        (Shutting the socket down wakes a blocked receive on another thread; closing it would
        not.)"""
        with contextlib.suppress(Exception):
            self._sock.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Release the socket; call once :meth:`pump` has returned. Never raises."""
        with contextlib.suppress(Exception):
            self._sock.shutdown()


def open_stream(
    core: k8s.CoreV1Api,
    lock: threading.Lock,
    pod: str,
    namespace: str,
    container: str,
    argv: Sequence[str],
    *,
    stdin: bool,
) -> ExecStream:
    """(worker thread) Open an exec stream running ``argv`` in ``container`` of Pod ``pod``.
    ``core`` must be a client of its own, used under ``lock``: ``kubernetes.stream`` swaps its
    ApiClient's ``call_api`` while it connects. :class:`SandboxError` when the API refuses (a
    missing or stopped Pod answers the handshake with an error)."""
    try:
        with lock:
            ws = k8s_stream(
                core.connect_get_namespaced_pod_exec,
                pod,
                namespace,
                command=list(argv),
                container=container,
                stdin=stdin,
                stdout=True,
                stderr=True,
                tty=False,
                binary=True,
                _preload_content=False,
            )
    except ApiException as e:
        raise SandboxError(f"kubernetes sandbox {pod}: exec refused: {api_error(e)}") from e
    except Exception as e:
        raise SandboxError(f"kubernetes sandbox {pod}: exec failed: {e}") from e
    return ExecStream(ws)


def in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run ``fn(*args)`` on a new daemon thread; its outcome arrives as a future of this loop.
    (Exec streams last as long as their command: the default executor is kept for short calls.)"""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn(*args))
        except BaseException as e:
            outcome = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="corral-k8s-exec", daemon=True).start()
    return fut


def pump(
    stream: ExecStream, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None]
) -> asyncio.Future[bytes | None]:
    """:meth:`ExecStream.pump` on a thread of its own; the stream is closed once it ends."""
    fut = in_thread(stream.pump, on_stdout, on_stderr)
    fut.add_done_callback(lambda _: stream.close())
    return fut


def send_all(stream: ExecStream, data: bytes) -> None:
    """Send ``data`` as stdin then close it; a stream closed meanwhile is fine (the command
    ended or was killed: its exit status says so)."""
    with contextlib.suppress(Exception):
        stream.send_stdin(data)
        stream.close_stdin()


def close_stream(fut: asyncio.Future[ExecStream]) -> None:
    """(done callback) Release the stream ``fut`` connected, nobody waiting for it any more."""
    if not fut.cancelled() and fut.exception() is None:
        s = fut.result()
        s.abort()
        s.close()


_background_tasks: set[asyncio.Task[None]] = set()


def background(coro: Awaitable[None]) -> None:
    """Run ``coro`` to its end even though nobody awaits it (kept referenced until then)."""
    task = asyncio.ensure_future(coro)
    _background_tasks.add(task)
    task.add_done_callback(_background_tasks.discard)


class KubernetesProcess(SandboxProcess):
    """A command started by :meth:`~corral.sandboxes.kubernetes.KubernetesSandbox.spawn`: an
    exec stream kept open. stdout and stderr frames arrive on the stream's reader thread and
    are handed to the event loop (:class:`~corral.sandboxes.streams.LineBuffer`); stdin is sent
    from a worker thread. ``kill_session`` kills its session inside (never raising)."""

    def __init__(
        self,
        stream: ExecStream,
        kill_session: Callable[[], Awaitable[None]],
        on_end: Callable[[KubernetesProcess], None],
    ) -> None:
        self._stream = stream
        self._kill_session = kill_session
        self._on_end = on_end
        self._loop = asyncio.get_running_loop()
        self._out = LineBuffer()
        self._pre = bytearray()  # stderr before the start marker
        self._started = asyncio.Event()
        self._aborted = False
        self.returncode: int | None = None  # once it ended, when the stream said
        self._pump = pump(
            stream, self._from_thread(self._feed_out), self._from_thread(self._feed_err)
        )
        self._pump.add_done_callback(self._ended)

    def _from_thread(self, fn: Callable[[bytes], None]) -> Callable[[bytes], None]:
        def hand_over(chunk: bytes) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody reads
                self._loop.call_soon_threadsafe(fn, chunk)

        return hand_over

    def _feed_out(self, chunk: bytes) -> None:
        self._out.feed(chunk)

    def _feed_err(self, chunk: bytes) -> None:
        if self._started.is_set():
            self._out.add_stderr(chunk)
            return
        self._pre += chunk
        mark = SPAWN_STARTED + b"\n"
        at = self._pre.find(mark)
        if at >= 0:
            self._started.set()
            rest = bytes(self._pre[:at] + self._pre[at + len(mark) :])
            self._pre.clear()
            if rest:
                self._out.add_stderr(rest)

    def _ended(self, fut: asyncio.Future[bytes | None]) -> None:
        if not fut.cancelled() and fut.exception() is None and (status := fut.result()):
            with contextlib.suppress(SandboxError):
                self.returncode = exit_code(status)
        self._out.close()
        self._on_end(self)
        if not self.killing and not self._aborted:
            # It ended by itself: what it left running in its session goes too (and the
            # session file with it).
            background(self._kill_session())

    async def wait_started(self, timeout: float) -> None:  # noqa: ASYNC109
        """Return once the command was exec'd; :class:`SandboxError` (saying why: the wrapper's
        stderr and exit code) when the stream ended first or ``timeout`` passed."""
        started: asyncio.Future[Any] = asyncio.ensure_future(self._started.wait())
        try:
            await asyncio.wait(
                {started, self._pump}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            started.cancel()
        if not self._started.is_set():
            why = self._pre.decode(errors="replace").strip() or "no output"
            if self._pump.done():
                raise SandboxError(
                    f"the command did not start (exit code {self.returncode}): {why}"
                )
            raise SandboxError(f"the command did not start within {timeout:g} s: {why}")

    async def write(self, data: bytes) -> None:
        if self.killing or self._pump.done():
            raise SandboxError("the process has exited")
        try:
            await asyncio.to_thread(self._stream.send_stdin, data)
        except Exception as e:
            raise SandboxError(f"the process has exited: {e}") from e

    async def readline(self) -> bytes:
        return await self._out.readline()

    async def _kill(self) -> None:
        """Kill the command's whole session inside (closing the stream alone would leave it
        running on a real cluster), then close the stream."""
        await self._kill_session()  # never raises
        self._stream.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._pump), 5.0)

    def abort(self) -> None:
        """Drop the stream without killing anything inside (the sandbox is being deleted)."""
        self._aborted = True
        self._stream.abort()

    def stderr_tail(self) -> str:
        return self._out.stderr_tail()
