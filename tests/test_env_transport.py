"""The servers' transport bounds idle and slow sockets (real uvicorn servers on 127.0.0.1).

Each test serves a small app, or the env server itself, with short limits passed as
arguments, attacks it over raw sockets and waits for the *server* to close them (a blocking
read with a generous upper bound, never a sleep). Trickling bytes with pauses is the attack
being tested, not synchronisation.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import websockets.sync.client
from fastapi import FastAPI, Request, Response, WebSocket
from websockets.exceptions import ConnectionClosedError, InvalidStatus

from corral.envs.client import EnvClient
from corral.transport import TransportLimits, fd_budget, hardened_config
from tests.servers import free_port, raw_connect, read_until_closed, serve

ROOT = Path(__file__).resolve().parent.parent
GRIDSIM = ROOT / "bundles" / "gridsim"
BOUND_S = 15.0  # generous upper bound on any wait for the server to act


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health(request: Request) -> dict[str, int]:
        # The client's port tells a test whether a keep-alive connection was reused.
        assert request.client is not None
        return {"port": request.client.port}

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        return Response(await request.body())

    @app.post("/refuse")
    async def refuse() -> Response:
        # Answers without reading the body, as an auth check does.
        return Response(status_code=401)

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            await websocket.send_text(message.get("text") or "")

    return app


@contextmanager
def _server(**limits: float) -> Iterator[tuple[str, int]]:
    """Serve the small app with ``TransportLimits(**limits)``; yield (url, port)."""
    port = free_port()
    with serve(_app(), port=port, limits=TransportLimits(**limits)) as url:  # type: ignore[arg-type]
        yield url, port


def _connect(port: int) -> socket.socket:
    return raw_connect(port, BOUND_S)


def _trickle(sock: socket.socket, data: bytes, every_s: float) -> threading.Thread:
    """Send ``data`` a byte at a time in a thread until it is sent or the server hangs up."""

    def run() -> None:
        for byte in data:
            try:
                sock.send(bytes([byte]))
            except OSError:
                return
            time.sleep(every_s)  # the attack's pace, not synchronisation

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_idle_socket_closed_after_head_deadline() -> None:
    """A socket that connects and sends nothing is closed after head_timeout_s, silently."""
    with _server(head_timeout_s=0.5) as (_, port), _connect(port) as sock:
        start = time.monotonic()
        assert read_until_closed(sock) == b""
        assert 0.4 <= time.monotonic() - start < 5


def test_slowloris_head_closed_with_408() -> None:
    """A head trickled a byte every 50 ms never completes in time: 408, then a close."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: y\r\n" * 1000 + b"\r\n"
    with _server(head_timeout_s=1.0) as (_, port), _connect(port) as sock:
        start = time.monotonic()
        _trickle(sock, head, 0.05)
        answer = read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert 0.9 <= time.monotonic() - start < 6


def test_slowloris_on_kept_alive_connection_closed() -> None:
    """After a response, the next head's first byte starts the head deadline: a trickle is
    closed long before the (much longer) keep-alive timeout."""
    with _server(head_timeout_s=1.0, keep_alive_s=60) as (_, port), _connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        _trickle(sock, b"GET /health HTTP/1.1\r\n" + b"X-Pad: y\r\n" * 1000, 0.05)
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - start < 6


def test_half_sent_body_gets_408() -> None:
    """A body that stops short of its Content-Length: 408 after body_timeout_s, then a close;
    the server then serves the next client."""
    with _server(body_timeout_s=0.5) as (url, port), _connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 10)
        start = time.monotonic()
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")
        assert 0.4 <= time.monotonic() - start < 5
        assert httpx.post(f"{url}/echo", content=b"b" * 1000, timeout=5).content == b"b" * 1000


def test_body_after_an_early_answer_is_still_bounded() -> None:
    """The app answers before the body is in: a body that never finishes is closed at the
    body deadline, and one that does finish leaves an idle connection that the keep-alive
    timeout closes (not one held for ever)."""
    head = b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    with ExitStack() as stack:
        _, port = stack.enter_context(_server(body_timeout_s=1.0, keep_alive_s=2))
        stalled, finished = (stack.enter_context(_connect(port)) for _ in range(2))
        for sock in (stalled, finished):
            sock.sendall(head + b"a" * 10)
            assert sock.recv(65536).startswith(b"HTTP/1.1 401 ")
        finished.sendall(b"a" * 90)
        start = time.monotonic()
        assert read_until_closed(stalled) == b""
        assert time.monotonic() - start < 5
        assert read_until_closed(finished) == b""
        assert time.monotonic() - start < 8


def test_large_body_in_time_is_served() -> None:
    """A 4 MiB body arriving in many reads, well inside body_timeout_s, is not cut off, and
    the head bytes limit does not count body bytes read with the head."""
    body = b"z" * (4 * 1024 * 1024)
    with _server(body_timeout_s=30, max_head_bytes=1024) as (url, _):
        assert httpx.post(f"{url}/echo", content=body, timeout=30).content == body


def test_oversized_head_gets_431() -> None:
    """A head over max_head_bytes is refused with 431 at once, not buffered."""
    with _server(max_head_bytes=4096) as (_, port), _connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"y" * 8192)
        assert read_until_closed(sock).startswith(b"HTTP/1.1 431 ")


def test_a_head_completed_in_one_read_is_bounded_too() -> None:
    """A whole head over max_head_bytes in one send (the read that completes it) gets 431;
    one just under it, sent the same way with a body larger than the cap, is served, and so
    is a request after blank lines."""
    pad = b"y" * 6000
    with _server(max_head_bytes=4096) as (_, port):
        with _connect(port) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + pad + b"\r\n\r\n")
            assert read_until_closed(sock).startswith(b"HTTP/1.1 431 ")
        body = b"z" * 8192
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        head += b"Content-Length: %d\r\nX-Pad: %s\r\n\r\n" % (len(body), b"y" * 3900)
        assert len(head) < 4096
        with _connect(port) as sock:
            sock.sendall(b"\r\n" + head + body)
            answer = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(body)
        with _connect(port) as sock:  # blank lines first do not end the head early
            sock.sendall(
                b"\r\n\r\n" + b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + pad + b"\r\n\r\n"
            )
            assert read_until_closed(sock).startswith(b"HTTP/1.1 431 ")


def test_idle_sockets_over_pending_cap_do_not_stop_health() -> None:
    """60 idle sockets against max_pending=20 (and a head deadline far away): the oldest are
    dropped at once, and /health answers within a second, over and over."""
    with _server(max_pending=20, head_timeout_s=60) as (url, port), ExitStack() as stack:
        socks = [stack.enter_context(_connect(port)) for _ in range(60)]
        with httpx.Client(timeout=BOUND_S) as client:
            for _ in range(5):
                start = time.monotonic()
                assert client.get(f"{url}/health").status_code == 200
                assert time.monotonic() - start < 1.0
        # The 40 oldest were dropped to keep 20 waiting (the newest survive): reading them
        # returns EOF now, long before the 60 s deadline.
        for sock in socks[:40]:
            assert read_until_closed(sock) == b""


def test_half_bodies_over_pending_cap_do_not_stop_health() -> None:
    """60 half-sent bodies against max_pending=20 (and a body deadline far away): a request
    with its body still due is incomplete too, so the oldest are dropped and /health answers
    within a second."""
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n\r\n"
    with _server(max_pending=20, body_timeout_s=60) as (url, port), ExitStack() as stack:
        socks = []
        for _ in range(60):
            sock = stack.enter_context(_connect(port))
            sock.sendall(head)
            # The 100 says the server has the head and the app waits for the body: each
            # socket is in its body stage before the next one connects.
            assert sock.recv(65536).startswith(b"HTTP/1.1 100 ")
            sock.sendall(b"a" * 10)
            socks.append(sock)
        with httpx.Client(timeout=BOUND_S) as client:
            for _ in range(5):
                start = time.monotonic()
                assert client.get(f"{url}/health").status_code == 200
                assert time.monotonic() - start < 1.0
        assert read_until_closed(socks[0]) == b""  # among the oldest: dropped


def test_keep_alive_client_reuses_its_connection() -> None:
    """A well-behaved keep-alive client gets every answer on one connection."""
    with _server(head_timeout_s=0.5) as (url, _), httpx.Client(timeout=BOUND_S) as client:
        ports = {client.get(f"{url}/health").json()["port"] for _ in range(5)}
        assert len(ports) == 1


def test_connection_cap_evicts_idle_then_answers_503() -> None:
    """With max_connections=2: an idle keep-alive connection is closed to make room; two
    live WebSockets fill the cap, and then a request gets 503 + Retry-After (HTTP and
    WebSocket alike); when one WebSocket closes, requests are served again."""
    with _server(max_connections=2, retry_after_s=3) as (url, port):
        with httpx.Client(timeout=BOUND_S) as a, httpx.Client(timeout=BOUND_S) as b:
            assert a.get(f"{url}/health").status_code == 200
            assert b.get(f"{url}/health").status_code == 200
            assert httpx.get(f"{url}/health", timeout=BOUND_S).status_code == 200
        ws_url = f"ws://127.0.0.1:{port}/ws"
        with websockets.sync.client.connect(ws_url) as one:
            with websockets.sync.client.connect(ws_url) as two:
                one.send("x")
                two.send("y")
                assert (one.recv(BOUND_S), two.recv(BOUND_S)) == ("x", "y")
                refused = httpx.get(f"{url}/health", timeout=BOUND_S)
                assert refused.status_code == 503
                assert refused.headers["retry-after"] == "3"
                with pytest.raises(InvalidStatus) as ws_refused:
                    websockets.sync.client.connect(ws_url, open_timeout=BOUND_S)
                assert ws_refused.value.response.status_code == 503
            assert _served_soon(f"{url}/health")


def _served_soon(url: str) -> bool:
    """True once ``url`` answers 200 (a closed WebSocket leaves the server a moment later)."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if httpx.get(url, timeout=BOUND_S).status_code == 200:
            return True
        time.sleep(0.05)  # polling interval, not synchronisation
    return False


def test_websocket_message_over_max_size_closed_with_1009() -> None:
    """A message over ws_max_size closes that socket with 1009; the server stays up and a
    new socket echoes normally."""
    with _server(ws_max_size=1024) as (url, port):
        ws_url = f"ws://127.0.0.1:{port}/ws"
        with websockets.sync.client.connect(ws_url) as ws:
            ws.send("a" * 2048)
            with pytest.raises(ConnectionClosedError) as closed:
                ws.recv(BOUND_S)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 1009
        with websockets.sync.client.connect(ws_url) as ws:
            ws.send("b" * 1000)
            assert ws.recv(BOUND_S) == "b" * 1000
        assert httpx.get(f"{url}/health", timeout=BOUND_S).status_code == 200


def test_bad_limits_and_owned_settings_are_refused() -> None:
    """Nonsense limits raise ValueError naming the field; a uvicorn setting the limits own
    raises TypeError instead of silently winning or losing."""
    with pytest.raises(ValueError, match="head_timeout_s"):
        TransportLimits(head_timeout_s=0)
    with pytest.raises(ValueError, match="max_pending"):
        TransportLimits(max_pending=0)
    with pytest.raises(TypeError, match="timeout_keep_alive"):
        hardened_config(_app(), TransportLimits(), timeout_keep_alive=5)


def _fitted_in_child(soft: int, hard: int) -> list[int]:
    """[max_pending, max_connections, soft limit after] from fd_budget(TransportLimits()) in
    a child process whose RLIMIT_NOFILE is (soft, hard): the limit is process-wide."""
    code = (
        "import resource; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
        "from corral.transport import TransportLimits, fd_budget; "
        "f = fd_budget(TransportLimits()); "
        "print(f.max_pending, f.max_connections, resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [int(word) for word in out.stdout.split()]


def test_caps_fit_the_fd_limit() -> None:
    """A low soft limit is raised towards the hard limit; where the hard limit is too low the
    caps shrink so that connections use at most half the descriptors."""
    default = TransportLimits()
    need = 2 * (default.max_pending + default.max_connections)
    assert _fitted_in_child(1024, need) == [default.max_pending, default.max_connections, need]
    assert _fitted_in_child(1024, 1024) == [128, 384, 1024]
    assert fd_budget(TransportLimits(max_connections=8)).max_connections == 8


def _start_env_server(port: int) -> subprocess.Popen[bytes]:
    """run_server(build_app(gridsim)) in a child with RLIMIT_NOFILE 256, max_pending=20 and a
    far head deadline; returns once it answers /health."""
    code = (
        "from corral.envs.running import run_server; from corral.envs.server import build_app; "
        "from corral.transport import TransportLimits; "
        f"run_server(build_app({str(GRIDSIM)!r}), port={port}, log_level='warning', "
        "limits=TransportLimits(max_pending=20, head_timeout_s=60))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        start_new_session=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)),
    )
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the env server did not come up")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.05)  # polling interval, not synchronisation


async def test_env_server_under_idle_attack_serves_health_and_reset() -> None:
    """The real env server (run_server in a subprocess) under RLIMIT_NOFILE 256: 300 idle
    sockets, more than its descriptors (which, unbounded, leaves every new client
    unanswered), do not stop /health (answered within a second) or a real client's reset."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = await asyncio.to_thread(_start_env_server, port)
    try:
        with ExitStack() as stack:
            socks = [stack.enter_context(_connect(port)) for _ in range(300)]
            async with httpx.AsyncClient(timeout=BOUND_S) as client:
                start = time.monotonic()
                assert (await client.get(f"{url}/health")).status_code == 200
                assert time.monotonic() - start < 1.0
            env = EnvClient(url, timeout=BOUND_S)
            try:
                first = await env.reset(split="eval", index=0)
                assert not first.done
            finally:
                await env.close()
            assert read_until_closed(socks[0]) == b""  # among the oldest: dropped
    finally:
        proc.terminate()
        proc.wait(30)
