"""The env server's lifecycle over real sockets: SIGTERM with live episodes, the client's
reconnect after a dropped socket, idle reaping seen by a client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from corral.envs.bundle import Bundle, load_bundle
from corral.envs.client import EnvClient, EnvClientError, EnvServerError, EpisodeLostError
from corral.envs.episodes import Episode, EpisodeManager
from corral.envs.server import build_app
from tests.servers import free_port, serve

ROOT = Path(__file__).resolve().parent.parent
GRIDSIM = ROOT / "bundles" / "gridsim"
IDLE = [0] * 24
START_S = 30.0  # bound on a subprocess server coming up
EXIT_S = 10.0  # bound on its exit after SIGTERM


@pytest.fixture(scope="module")
def bundle() -> Bundle:
    return load_bundle(GRIDSIM)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str) -> None:
    """Poll ``/health`` of the server ``proc`` runs, failing fast if ``proc`` dies."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            pytest.fail(f"the server exited with {proc.returncode} before serving:\n{out}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # polling interval, not synchronisation
    pytest.fail(f"the server at {url} was not healthy within {START_S:g} s")


def _start(argv: list[str]) -> subprocess.Popen[bytes]:
    """Start a server process in a session of its own (its process group is checked later)."""
    return subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill the server process if a failed test left it running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)
    if proc.stdout:
        proc.stdout.close()


def _descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc; psutil is not a dependency)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


SERVE_CLI = [sys.executable, "-m", "corral.cli", "serve", str(GRIDSIM), "--port", "{port}"]
SERVE_HELPER = [
    sys.executable,
    "-c",
    "from corral.envs.running import run_server; from corral.envs.server import build_app; "
    f"run_server(build_app({str(GRIDSIM)!r}), port={{port}}, log_level='warning')",
]


@pytest.mark.parametrize(
    ("command", "codes"),
    [
        pytest.param(SERVE_CLI, {1001}, id="corral-serve"),
        pytest.param(SERVE_HELPER, {1001}, id="run_server"),
    ],
)
async def test_sigterm_closes_live_episodes_and_exits(command: list[str], codes: set[int]) -> None:
    """Three live episodes, SIGTERM: every client is told, the process exits 0 promptly and
    leaves nothing running."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [part.replace("{port}", str(port)) for part in command]
    proc = _start(argv)
    clients = [EnvClient(url, timeout=10) for _ in range(3)]
    try:
        await asyncio.to_thread(_wait_healthy, proc, url)
        for i, env in enumerate(clients):
            first = await env.reset(split="eval", index=i)
            assert not first.done
        children = _descendants(proc.pid)

        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, EXIT_S)  # TimeoutExpired: not prompt

        for env in clients:
            with pytest.raises(EnvClientError) as lost:
                await env.call_tool("simulate_schedule", {"schedule": IDLE})
            assert isinstance(lost.value, EpisodeLostError)
            assert any(f"code {code}" in str(lost.value) for code in codes), lost.value
        if codes == {1001}:
            assert "shutting down" in str(lost.value)
        # Nothing left running: no descendant, nothing in the server's process group.
        assert not [pid for pid in children if _alive(pid)]
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)
        assert rc == 0, proc.stdout.read().decode() if proc.stdout else ""
    finally:
        for env in clients:
            await env.close()
        _stop(proc)


async def test_client_reconnects_after_a_restart_but_never_resumes_an_episode(
    bundle: Bundle,
) -> None:
    port = free_port()
    env = EnvClient(f"http://127.0.0.1:{port}", timeout=10)
    try:
        with serve(build_app(bundle), port=port):
            await env.reset(split="eval", index=0)
            await env.call_tool("simulate_schedule", {"schedule": IDLE})
        # The server is gone: the episode with it, and the error says so (every time).
        for _ in range(2):
            with pytest.raises(EpisodeLostError, match="episode was lost"):
                await env.call_tool("simulate_schedule", {"schedule": IDLE})
        with serve(build_app(bundle), port=port):
            with pytest.raises(EpisodeLostError):
                await env.state()
            again = await env.reset(split="eval", index=1)  # a fresh socket
            assert again.observation.task_id == "eval-0001" and again.observation.step == 0
            out = await env.call_tool("simulate_schedule", {"schedule": IDLE})
            assert not out.done and out.observation.step == 1
            end = await env.call_tool("submit_schedule", {"schedule": IDLE})
            assert end.done
        # No episode in progress when the socket dropped: the next call just reconnects.
        with serve(build_app(bundle), port=port):
            first = await env.reset(split="train", index=2)
            assert first.observation.task_id == "train-0002"
    finally:
        await env.close()


async def test_client_with_no_server_fails_then_recovers(bundle: Bundle) -> None:
    port = free_port()
    env = EnvClient(f"http://127.0.0.1:{port}", timeout=10, open_timeout=2)
    try:
        with pytest.raises(EnvClientError, match="cannot connect"):
            await env.reset(split="eval", index=0)
        with serve(build_app(bundle), port=port):
            assert not (await env.reset(split="eval", index=0)).done
    finally:
        await env.close()


async def test_idle_episode_is_reaped_and_the_client_is_told(bundle: Bundle) -> None:
    app = build_app(bundle, idle_timeout=0.2)
    manager: EpisodeManager = app.state.episodes
    reaped = threading.Event()  # set on the server's thread, waited on here
    victims: list[Episode] = []

    def on_reap(episode: Episode) -> None:
        victims.append(episode)
        reaped.set()

    manager.on_reap = on_reap
    with serve(app) as url:
        async with EnvClient(url, timeout=10) as env:
            await env.reset(split="eval", index=0)
            assert await asyncio.to_thread(reaped.wait, 10), "no episode reaped within 10 s"
            assert [v.task.id for v in victims] == ["eval-0000"]
            assert manager.active == 0
            with pytest.raises(EnvServerError) as idle:
                await env.call_tool("simulate_schedule", {"schedule": IDLE})
            assert idle.value.code == "SESSION_ERROR" and "idle" in str(idle.value)
            # The socket plays on: a reset starts a fresh episode.
            assert not (await env.reset(split="eval", index=1)).done


async def test_sigterm_wakes_a_reset_waiting_for_capacity() -> None:
    """A reset waiting for room (reset_timeout 600 s) must not hold the shutdown up."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    code = (
        "from corral.envs.running import run_server; from corral.envs.server import build_app; "
        f"run_server(build_app({str(GRIDSIM)!r}, max_concurrent_envs=1, reset_timeout=600), "
        f"port={port}, log_level='warning')"
    )
    proc = _start([sys.executable, "-c", code])
    holder, waiter = EnvClient(url, timeout=10), EnvClient(url, timeout=10, reset_timeout=30)
    try:
        await asyncio.to_thread(_wait_healthy, proc, url)
        await holder.reset(split="eval", index=0)
        waiting = asyncio.create_task(waiter.reset(split="eval", index=1))
        # Synchronise on the server's own gauge: the second reset is waiting for room.
        deadline = time.monotonic() + 10
        async with httpx.AsyncClient() as http:
            while "corral_env_waiting_resets 1.0" not in (await http.get(f"{url}/metrics")).text:
                assert time.monotonic() < deadline, "the second reset never waited"
                await asyncio.sleep(0.02)  # polling interval
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, EXIT_S) == 0
        with pytest.raises(EnvClientError):
            await asyncio.wait_for(waiting, 5)
    finally:
        await holder.close()
        await waiter.close()
        _stop(proc)
