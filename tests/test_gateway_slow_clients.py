"""The gateway holds up under idle and slowloris sockets (a real gateway on 127.0.0.1).

The gateway is served as ``corral gateway`` serves it: through :mod:`corral.serving` with
corral's transport limits (:class:`~corral.transport.TransportLimits`), only the timeouts
shortened so that the test is quick. In front of the scripted test engine, it is attacked
with raw sockets while a real client checks ``/health`` and plays a session; then the test
waits for the *server* to close every attacking socket (blocking reads with a generous upper
bound, never a sleep) and counts the server-side sockets through ``/proc``. Trickling bytes
with pauses is the attack being tested, not synchronisation.
"""

from __future__ import annotations

import os
import resource
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from corral.transport import TransportLimits
from tests.gateway_stack import AUTH, ScriptedStack, scripted_gateway
from tests.servers import raw_connect, read_until_closed

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/net/tcp").exists(), reason="counts server-side sockets through /proc"
)

IDLE = 300  # sockets that connect and send nothing
SLOW = 50  # sockets that trickle a request head and never finish it
HEAD_TIMEOUT_S = 3.0  # long enough for the real client's work to fit while all are held
HEALTH_BOUND_S = 2.0  # how fast /health must answer under attack
BOUND_S = 15.0  # generous upper bound on any wait for the server to act
TRICKLE_S = 0.5  # the slowloris pace


@pytest.fixture
def enough_descriptors() -> Iterator[None]:
    """Both ends of every socket live in this process: raise the soft fd limit if short."""
    need = 4 * (IDLE + SLOW) + 1024  # both ends, the servers' own, files and slack
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _server_side_peers(port: int) -> set[int]:
    """The remote ports of this process's open sockets accepted on ``port`` (server side).

    A socket the server has closed leaves this process's fds at once, even while the kernel
    keeps its TCP state (FIN_WAIT2, no inode), so this counts what the server still holds.
    """
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since listed
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    peers = set()
    with open("/proc/self/net/tcp") as table:
        next(table)  # header
        for line in table:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            if int(local.split(":")[1], 16) == port and state != "0A" and inode in inodes:
                peers.add(int(remote.split(":")[1], 16))  # 0A: LISTEN
    return peers


def _connect(port: int) -> socket.socket:
    return raw_connect(port, BOUND_S)


def _still_open(sock: socket.socket) -> bool:
    """Nothing sent by the server and no EOF or reset yet: not readable, polled now."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


def _slowloris(socks: list[socket.socket], stop: threading.Event) -> threading.Thread:
    """Send each socket a request line, then one header byte each every ``TRICKLE_S`` s,
    never ending the head, until ``stop`` is set or the server has hung up on all of them."""

    def run() -> None:
        live = list(socks)
        for sock in live:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        while live and not stop.wait(TRICKLE_S):  # the attack's pace, not synchronisation
            for sock in list(live):
                try:
                    sock.send(b"a")
                except OSError:
                    live.remove(sock)

    thread = threading.Thread(target=run, name="slowloris", daemon=True)
    thread.start()
    return thread


def _healthy(client: httpx.Client, url: str) -> None:
    start = time.monotonic()
    r = client.get(f"{url}/health")
    took = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert took < HEALTH_BOUND_S, f"/health took {took:.2f} s under attack"


def _play_a_session(gateway: ScriptedStack, client: httpx.Client) -> None:
    """A real client's work: a session created with the admin token, one chat completion."""
    r = client.post(f"{gateway.url}/sessions", headers=AUTH, json={})
    assert r.status_code == 201, r.text
    session = r.json()
    gateway.engine.push(gateway.ids("Hello there."))
    r = client.post(
        f"{session['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {session['api_key']}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}]},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello there."


@pytest.mark.usefixtures("enough_descriptors")
def test_idle_and_slowloris_sockets_neither_stop_the_gateway_nor_outlive_the_head_timeout(
    tiny_model_dir: Path,
) -> None:
    """300 idle and 50 slowloris sockets: while all are held, /health answers within 2 s
    again and again and a session plays a turn; then the server closes every one of them
    at the head deadline (408 for a partial head) and holds none of them any more."""
    limits = TransportLimits(head_timeout_s=HEAD_TIMEOUT_S)  # the rest as `corral gateway`'s
    stop = threading.Event()
    with scripted_gateway(tiny_model_dir, limits=limits) as gateway, ExitStack() as stack:
        stack.callback(stop.set)
        port = _port(gateway.url)
        opened = time.monotonic()
        idle = [stack.enter_context(_connect(port)) for _ in range(IDLE)]
        slow = [stack.enter_context(_connect(port)) for _ in range(SLOW)]
        attackers = {sock.getsockname()[1] for sock in idle + slow}
        sender = _slowloris(slow, stop)

        with httpx.Client(timeout=BOUND_S) as client:
            for _ in range(5):
                _healthy(client, gateway.url)
            _play_a_session(gateway, client)
            _healthy(client, gateway.url)
            # The work above was done while every attacking socket was held: the server
            # accepted them all (they were queued before the client's own connection) and
            # closed none.
            held = _server_side_peers(port) & attackers
            assert len(held) == IDLE + SLOW, (
                f"{len(held)} held after {time.monotonic() - opened:.2f} s; raise HEAD_TIMEOUT_S "
                "if this machine is too slow for the work to fit inside it"
            )
            assert all(_still_open(sock) for sock in idle + slow)

            # The server closes each at its head deadline: idle ones with nothing said,
            # slowloris ones with a 408 (or a reset, if a trickled byte crossed the close).
            for sock in idle:
                assert read_until_closed(sock) == b""
            for sock in slow:
                answer = read_until_closed(sock)
                assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer[:80]
            closed_after = time.monotonic() - opened
            assert closed_after >= HEAD_TIMEOUT_S * 0.9  # the deadline closed them, not a cap
            stop.set()
            sender.join(timeout=BOUND_S)
            assert not sender.is_alive()
            # Each server-side socket is closed before its peer can read EOF: none is left.
            assert _server_side_peers(port) & attackers == set()
            _healthy(client, gateway.url)


@pytest.mark.usefixtures("enough_descriptors")
def test_unauthenticated_keep_alive_connections_are_closed_when_idle(
    tiny_model_dir: Path,
) -> None:
    """50 sockets each send one complete request without a token (answered 401) and then sit
    idle: the keep-alive timeout closes them; the head deadline no longer applies."""
    limits = TransportLimits(head_timeout_s=1.0, keep_alive_s=2)
    with scripted_gateway(tiny_model_dir, limits=limits) as gateway, ExitStack() as stack:
        port = _port(gateway.url)
        socks = [stack.enter_context(_connect(port)) for _ in range(50)]
        opened = time.monotonic()
        for sock in socks:
            sock.sendall(b"GET /sessions HTTP/1.1\r\nHost: x\r\n\r\n")
        with httpx.Client(timeout=BOUND_S) as client:
            _healthy(client, gateway.url)
            for sock in socks:
                answer = read_until_closed(sock)
                assert answer.startswith(b"HTTP/1.1 401 "), answer[:80]
            assert time.monotonic() - opened >= limits.keep_alive_s * 0.9
            peers = {sock.getsockname()[1] for sock in socks}
            assert _server_side_peers(port) & peers == set()
            _healthy(client, gateway.url)
