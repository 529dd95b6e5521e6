"""corral.serving starts every server: real uvicorn servers on 127.0.0.1.

Each test waits on what the server itself reports (its "Uvicorn running on" line, a closed
socket, a process exit), with a generous upper bound, never on a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from corral.serving import BindError, serve_forever, serve_in_loop, serve_in_thread
from corral.transport import TransportLimits
from tests.viewer_folders import write_eval_folder

ROOT = Path(__file__).resolve().parent.parent
GRIDSIM = ROOT / "bundles" / "gridsim"
BOUND_S = 30.0  # generous upper bound on any wait for a server to act

# A tiny app served by serve_forever in a child process; each step of its end is noted in
# the file named by argv[1], in the order it happens.
FOREVER_SCRIPT = textwrap.dedent(
    """
    import contextlib, sys
    from pathlib import Path
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from corral.serving import serve_forever

    record = Path(sys.argv[1])

    def note(what):
        with record.open("a") as out:
            out.write(what + "\\n")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        note("lifespan shutdown")

    async def health(request):
        return PlainTextResponse("ok")

    async def on_shutdown():
        note("on_shutdown")

    app = Starlette(routes=[Route("/health", health)], lifespan=lifespan)
    serve_forever(app, host="127.0.0.1", port=0, on_shutdown=on_shutdown)
    note("returned")
    """
)


async def _health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def _app() -> Starlette:
    return Starlette(routes=[Route("/health", _health)])


def _failing_app() -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        raise RuntimeError("no database")
        yield

    return Starlette(routes=[Route("/health", _health)], lifespan=lifespan)


@contextlib.contextmanager
def _taken_port() -> Iterator[int]:
    """A port some other socket is listening on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def _lines(stream: object) -> queue.Queue[str]:
    """The lines of ``stream``, read in a thread, so a wait on one can have a bound."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.put(line)
        lines.put("")  # end of the stream

    threading.Thread(target=read, daemon=True).start()
    return lines


def _listening_url(lines: queue.Queue[str]) -> str:
    """The URL in the server's "Uvicorn running on" line (its port was picked at bind)."""
    seen: list[str] = []
    while True:
        line = lines.get(timeout=BOUND_S)
        assert line, f"the server exited before listening: {''.join(seen)}"
        seen.append(line)
        if found := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line):
            return found.group(1)


def _child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


def test_serve_forever_answers_then_exits_0_on_sigterm_after_on_shutdown(tmp_path: Path) -> None:
    record = tmp_path / "record.txt"
    script = tmp_path / "forever.py"
    script.write_text(FOREVER_SCRIPT)
    child = subprocess.Popen(
        [sys.executable, str(script), str(record)],
        cwd=ROOT,
        env=_child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = _listening_url(_lines(child.stderr))
        assert httpx.get(f"{url}/health", timeout=BOUND_S).text == "ok"

        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=BOUND_S) == 0
        # on_shutdown before uvicorn's shutdown (whose end is the lifespan's), then a return.
        assert record.read_text().splitlines() == ["on_shutdown", "lifespan shutdown", "returned"]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=BOUND_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_serve_forever_on_a_taken_port_raises_bind_error() -> None:
    with _taken_port() as port, pytest.raises(BindError) as refused:
        serve_forever(_app(), host="127.0.0.1", port=port)
    assert isinstance(refused.value, OSError)
    assert refused.value.errno == errno.EADDRINUSE
    assert str(refused.value) == f"cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize("command", ["view", "serve"])
def test_a_server_command_on_a_taken_port_fails_with_one_line(tmp_path: Path, command: str) -> None:
    target = write_eval_folder(tmp_path / "eval", n=3) if command == "view" else GRIDSIM
    with _taken_port() as port:
        result = subprocess.run(
            [sys.executable, "-m", "corral.cli", command, str(target), "--port", str(port)],
            cwd=ROOT,
            env=_child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"corral {command}: cannot listen on 127.0.0.1:{port}: Address already in use. "
        "Pass another --port, or stop what listens there."
    )
    assert "Traceback" not in result.stderr


async def test_serve_in_loop_answers_and_frees_its_port() -> None:
    async with serve_in_loop(_app()) as url:
        async with httpx.AsyncClient(timeout=BOUND_S) as http:
            assert (await http.get(f"{url}/health")).text == "ok"
        port = int(url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=BOUND_S).close()
    with socket.socket() as again:  # the port is free to bind again
        again.bind(("127.0.0.1", port))


async def test_serve_in_loop_raises_when_the_apps_startup_fails() -> None:
    with pytest.raises(RuntimeError, match="did not start"):
        async with serve_in_loop(_failing_app()):
            pytest.fail("the block must not run")
    # The event loop lives on (uvicorn's sys.exit did not escape into it).
    assert await asyncio.sleep(0, "alive") == "alive"


def test_serve_in_thread_raises_when_it_cannot_start() -> None:
    with pytest.raises(RuntimeError, match="did not start"), serve_in_thread(_failing_app()):
        pytest.fail("the block must not run")
    with (
        _taken_port() as port,
        pytest.raises(RuntimeError, match="Address already in use"),
        serve_in_thread(_app(), port=port),
    ):
        pytest.fail("the block must not run")


async def _read_until_closed(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    while True:
        try:
            chunk = await reader.read(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


async def test_serve_in_loop_applies_the_transport_limits() -> None:
    """An oversized request head is refused with 431 (corral.transport), as on every server."""
    async with serve_in_loop(_app(), limits=TransportLimits(max_head_bytes=4096)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"y" * 8192)
            await writer.drain()
            answer = await asyncio.wait_for(_read_until_closed(reader), BOUND_S)
        finally:
            writer.close()
        assert answer.startswith(b"HTTP/1.1 431 ")
