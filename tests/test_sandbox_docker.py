"""The docker sandbox backend against a real dockerd (the ``docker_daemon`` fixture in
conftest.py starts one when none is reachable, and builds the sandbox image)."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral.sandboxes.base import SandboxError, SandboxSpec

IMAGE = "corral-sandbox:py3"


@pytest.fixture
def provider(docker_daemon: None) -> Any:
    from corral.sandboxes.docker import DockerProvider

    return DockerProvider(f"test-{uuid.uuid4().hex[:8]}", image=IMAGE)


@pytest.fixture
async def sandbox(provider: Any) -> AsyncIterator[Any]:
    sb = await provider.create(SandboxSpec(memory_mb=128, pids=64, cpus=1.0, ttl_s=600))
    try:
        yield sb
    finally:
        await sb.close()


async def test_exec_basics(sandbox: Any) -> None:
    r = await sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10)
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.killed) == (3, "out\n", "err\n", 0, 0)
    r = await sandbox.exec(["sh", "-c", "echo $FOO; pwd"], timeout=10, env={"FOO": "bar"})
    assert r.stdout == "bar\n/work\n"
    r = await sandbox.exec(["pwd"], timeout=10, cwd="/tmp")
    assert r.stdout == "/tmp\n"
    r = await sandbox.exec(["cat"], timeout=10, stdin=b"piped in")
    assert r.stdout == "piped in"
    r = await sandbox.exec(["python3", "-c", "print(6 * 7)"], timeout=10)
    assert r.stdout == "42\n"


async def test_files_round_trip(sandbox: Any) -> None:
    data = bytes(range(256)) * 1000
    await sandbox.write_file("/work/sub/dir/blob.bin", data)
    assert await sandbox.read_file("/work/sub/dir/blob.bin") == data
    assert await sandbox.read_file("sub/dir/blob.bin") == data  # relative to the workdir
    r = await sandbox.exec(["wc", "-c", "sub/dir/blob.bin"], timeout=10)
    assert r.stdout.split()[0] == str(len(data))
    await sandbox.exec(["sh", "-c", "printf made > /work/out.txt"], timeout=10)
    assert await sandbox.read_file("/work/out.txt") == b"made"
    await sandbox.write_file("/tmp/t.txt", b"in tmp")  # outside the workdir: through exec
    assert await sandbox.read_file("/tmp/t.txt") == b"in tmp"
    with pytest.raises(SandboxError):
        await sandbox.read_file("/work/missing")
    with pytest.raises(SandboxError):
        await sandbox.read_file("/tmp/missing")


async def _sleepers(sandbox: Any) -> list[str]:
    r = await sandbox.exec(["ps", "-eo", "args="], timeout=10)
    return [line for line in r.stdout.splitlines() if line.startswith("sleep 7")]


async def test_host_side_kill_catches_what_leaves_the_group(sandbox: Any) -> None:
    # A child that moves to a process group of its own is out of ``timeout``'s reach; the
    # host-side kill of the exec's session must end it too.
    escape = "import os; os.setpgid(0, 0); os.execvp('sleep', ['sleep', '71'])"
    t0 = time.monotonic()
    r = await sandbox.exec(["sh", "-c", f'python3 -c "{escape}"; echo no'], timeout=1)
    assert r.timed_out and "no" not in r.stdout
    assert time.monotonic() - t0 < 15
    assert await _sleepers(sandbox) == []


async def test_memory_hog_is_killed_and_reported(sandbox: Any) -> None:
    hog = "b = bytearray(400 * 1024 * 1024); print(len(b))"
    r = await sandbox.exec(["python3", "-c", hog], timeout=30)
    assert r.exit_code == 137 and r.killed and r.reason is not None and "memory" in r.reason
    assert not r.timed_out
    assert (await sandbox.exec(["true"], timeout=10)).exit_code == 0  # the sandbox lives on


async def test_fork_bomb_is_contained(sandbox: Any) -> None:
    r = await sandbox.exec(["sh", "-c", "b() { b | b & }; b; sleep 30"], timeout=3)
    assert r.killed and r.reason == "pids"
    assert await sandbox.is_alive()
    for _ in range(20):  # the bomb's leftovers die with their group; the sandbox recovers
        r = await sandbox.exec(["sh", "-c", "ps -e | wc -l"], timeout=10)
        if r.exit_code == 0 and int(r.stdout) < 10:
            break
        await asyncio.sleep(0.5)
    assert r.exit_code == 0 and int(r.stdout) < 10


async def test_no_network(sandbox: Any) -> None:
    from tests.servers import serve

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"host"})

    with serve(app) as url:
        port = int(url.rsplit(":", 1)[1].strip("/"))
        probe = (
            "import socket,sys\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
            "except OSError as e:\n"
            "    print('refused', e); sys.exit(0)\n"
            "print('CONNECTED'); sys.exit(1)\n"
        )
        r = await sandbox.exec(["python3", "-c", probe], timeout=20)
        assert r.exit_code == 0 and "refused" in r.stdout, r
        r = await sandbox.exec(["cat", "/proc/net/dev"], timeout=10)
        interfaces = [line.split(":")[0].strip() for line in r.stdout.splitlines()[2:]]
        assert interfaces == ["lo"]
    with pytest.raises(SandboxError):
        await sandbox.endpoint(8080)


async def test_host_files_and_processes_are_invisible(sandbox: Any) -> None:
    marker = Path("/root") / f".corral-marker-{uuid.uuid4().hex}"
    try:
        marker.write_text("host secret")
        r = await sandbox.exec(["sh", "-c", f"cat {marker}; ls -a /root"], timeout=10)
        assert "host secret" not in r.stdout and marker.name not in r.stdout
    except PermissionError:
        pytest.skip("cannot write the marker into the host's /root")
    finally:
        marker.unlink(missing_ok=True)
    r = await sandbox.exec(["ps", "-eo", "pid=,args="], timeout=10)
    assert "pytest" not in r.stdout and "dockerd" not in r.stdout
    assert len(r.stdout.splitlines()) < 10


async def test_read_only_root_and_no_capabilities(sandbox: Any) -> None:
    r = await sandbox.exec(["sh", "-c", "touch /etc/x"], timeout=10)
    assert r.exit_code != 0 and "Read-only" in r.stderr
    r = await sandbox.exec(["sh", "-c", "grep CapEff /proc/self/status"], timeout=10)
    assert r.stdout.split()[1] == "0000000000000000"
    r = await sandbox.exec(["sh", "-c", "touch /work/ok /tmp/ok"], timeout=10)
    assert r.exit_code == 0


async def test_labels_list_and_close_idempotent(provider: Any) -> None:
    import docker

    sb = await provider.create(SandboxSpec(labels={"episode": "e1"}))
    assert await provider.list_owned() == [sb.id]
    c = docker.from_env().containers.get(sb.id)
    hc = c.attrs["HostConfig"]
    assert c.labels["corral.owner"] == provider.owner and c.labels["episode"] == "e1"
    assert hc["ReadonlyRootfs"] and hc["CapDrop"] == ["ALL"] and hc["NetworkMode"] == "none"
    assert hc["SecurityOpt"] == ["no-new-privileges"] and hc["PidsLimit"] == 256
    assert await sb.is_alive()
    await sb.close()
    await sb.close()
    assert not await sb.is_alive()
    assert await provider.list_owned() == []


async def test_refused_policies(provider: Any) -> None:
    from corral.sandboxes.base import NetworkPolicy

    for mode in ("loopback", "allowlist"):
        with pytest.raises(SandboxError):
            await provider.create(SandboxSpec(network=NetworkPolicy(mode=mode)))
    assert await provider.list_owned() == []


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited (an owner that crashed)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


async def test_sweep_removes_dead_owners_and_expired(
    provider: Any, dead_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import corral.sandboxes.docker as backend

    live = await provider.create(SandboxSpec())
    with monkeypatch.context() as m:
        m.setattr(backend.os, "getpid", lambda: dead_pid)
        orphan = await provider.create(SandboxSpec())
    expired = await provider.create(SandboxSpec(ttl_s=0.01))
    await asyncio.sleep(0.05)
    try:
        swept = await provider.sweep()
        assert orphan.id in swept and expired.id in swept and live.id not in swept
        assert await provider.list_owned() == [live.id]
        assert not await orphan.is_alive()
    finally:
        for sb in (live, orphan, expired):
            await sb.close()


async def test_start_latency(provider: Any) -> None:
    """Create + first exec; the target is a p50 under 1.5 s on this machine."""
    times = []
    for _ in range(5):
        t0 = time.monotonic()
        sb = await provider.create(SandboxSpec())
        try:
            assert (await sb.exec(["true"], timeout=10)).exit_code == 0
            times.append(time.monotonic() - t0)
        finally:
            await sb.close()
    p50 = statistics.median(times)
    print(f"docker start latency (create + first exec): p50 {p50:.3f} s, max {max(times):.3f} s")
    assert p50 < 3.0  # generous bound for loaded CI machines; the report states the measurement
