"""One contract for every sandbox backend, the same tests run against each:

- ``local`` and ``bwrap``: real, on this host (bwrap needs bubblewrap and pyseccomp);
- ``kubernetes``: the stand-in API server of :mod:`tests.k8s_standin` (its Pods are bwrap
  sandboxes), driven by the real ``kubernetes`` client, as in ``test_sandbox_kubernetes.py``;
- ``e2b``: the stand-in of E2B's service in ``test_sandbox_e2b.py`` (its commands are this
  host's processes), driven by the real ``e2b`` SDK;
- ``docker``: a real dockerd (the ``docker_daemon`` fixture in conftest.py). Its cases carry
  ``docker`` in their ids: ``-k "not docker"`` leaves them out.

The contract: exec reports output and exit code (environment, stdin and working folder
honoured); a timeout kills the command's whole tree; files go in and come out; a spawned
process talks over stdin/stdout and its kill ends its whole session; an exec whose caller is
cancelled raises ``CancelledError`` and leaves no process behind; close is idempotent and ends
the sandbox. Leftover processes are looked for by a marker in their command line: from inside
the sandbox where a later exec sees an earlier one's processes (kubernetes, docker), on this
host otherwise (local and e2b run on it; bwrap gives each exec a pid namespace of its own).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral.sandboxes import shell
from corral.sandboxes.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec
from corral.sandboxes.image import DEFAULT_TAG

pytestmark = pytest.mark.timeout(240)

BACKENDS = ["local", "bwrap", "kubernetes", "e2b", "docker"]

# Lists the processes whose command line holds the marker, given reversed (so that this
# script's own command line does not hold it). Run inside the sandbox.
FIND = (
    "import os, sys\n"
    "mark = sys.argv[1][::-1].encode()\n"
    "for p in os.listdir('/proc'):\n"
    "    if p.isdigit():\n"
    "        try:\n"
    "            c = open('/proc/' + p + '/cmdline', 'rb').read()\n"
    "        except OSError:\n"
    "            continue\n"
    "        if mark in c:\n"
    "            print(p, c.replace(b'\\0', b' ').decode(errors='replace'))\n"
)


def _has_bwrap() -> bool:
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError):
        return False
    return shutil.which("bwrap") is not None


def _host_processes(marker: str) -> list[str]:
    """This host's processes whose command line holds ``marker`` (zombies have none)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            args = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry} {args}")
    return found


@dataclass
class Backend:
    """One backend's provider and spec, and where its leftover processes are looked for:
    ``inside`` the sandbox (an exec sees the processes of earlier ones) or on this host."""

    name: str
    provider: SandboxProvider
    spec: SandboxSpec
    inside: bool

    async def processes(self, sandbox: Sandbox, marker: str) -> list[str]:
        """The processes whose command line holds ``marker`` (see the module docstring)."""
        if not self.inside:
            return _host_processes(marker)
        found = await sandbox.exec(["python3", "-c", FIND, marker[::-1]], timeout=30)
        assert found.exit_code == 0, found
        return found.stdout.splitlines()


@pytest.fixture(scope="module")
def k8s_standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not _has_bwrap():
        pytest.skip("the kubernetes stand-in runs Pods in bwrap: bubblewrap and pyseccomp")
    from tests.k8s_standin import StandIn

    standin = StandIn(tmp_path_factory.mktemp("k8s-standin"), images=(DEFAULT_TAG,))
    standin.start()
    yield standin
    standin.stop()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    owner = f"contract-{uuid.uuid4().hex[:8]}"
    name = request.param
    if name == "local":
        from corral.sandboxes.local import LocalProvider

        yield Backend(name, LocalProvider(owner, tmp_path / "state"), SandboxSpec(), False)
    elif name == "bwrap":
        if not _has_bwrap():
            pytest.skip("bwrap needs `apt-get install bubblewrap` and `pip install pyseccomp`")
        from corral.sandboxes.bwrap import BwrapProvider

        yield Backend(name, BwrapProvider(owner, tmp_path / "state"), SandboxSpec(), False)
    elif name == "kubernetes":
        from kubernetes import client as k8s

        from corral.sandboxes.kubernetes import KubernetesProvider

        standin = request.getfixturevalue("k8s_standin")
        api = k8s.ApiClient(k8s.Configuration(host=standin.url))
        provider = KubernetesProvider(owner, image=DEFAULT_TAG, api_client=api, start_timeout=60)
        yield Backend(name, provider, SandboxSpec(ttl_s=600), True)
        assert standin.unexpected == [], "the backend made a call the stand-in lacks"
    elif name == "e2b":
        pytest.importorskip(
            "e2b", reason="the e2b SDK is not installed (pip install 'corral[e2b]')"
        )
        from tests.servers import serve
        from tests.test_sandbox_e2b import StandIn, make_provider

        service = StandIn(tmp_path / "e2b")
        with serve(service) as url:
            service.url = url
            try:
                # The stand-in's sandboxes are this host's processes: their folder is ours.
                spec = SandboxSpec(workdir=str(tmp_path / "work"), ttl_s=600)
                yield Backend(name, make_provider(service), spec, False)
            finally:
                for sid in list(service.sandboxes):
                    service.kill_now(sid)
    else:
        request.getfixturevalue("docker_daemon")
        from corral.sandboxes.docker import DockerProvider

        yield Backend(name, DockerProvider(owner, image=DEFAULT_TAG), SandboxSpec(ttl_s=600), True)


@pytest.fixture
async def sandbox(backend: Backend) -> AsyncIterator[Sandbox]:
    sb = await backend.provider.create(backend.spec)
    try:
        yield sb
    finally:
        await sb.close()


def _marker() -> str:
    """A ``sleep`` duration no other process uses (its reverse never equals it)."""
    return f"{secrets.randbelow(9000) + 1000}.{secrets.randbelow(900000) + 100000}"


async def _until(check: Callable[[], Awaitable[bool]], what: str, within: float = 20.0) -> None:
    """Poll ``check`` until it holds (processes die and appear asynchronously); fail after
    ``within`` seconds saying what was awaited."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


async def _appears(backend: Backend, sandbox: Sandbox, marker: str) -> None:
    async def seen() -> bool:
        return bool(await backend.processes(sandbox, marker))

    await _until(seen, f"a process of `sleep {marker}` to run")


async def _all_gone(backend: Backend, sandbox: Sandbox, marker: str) -> None:
    async def gone() -> bool:
        return not await backend.processes(sandbox, marker)

    await _until(gone, f"every process of `sleep {marker}` to be gone")


# ---- exec -----------------------------------------------------------------------------------


async def test_exec_output_exit_code_env_stdin_and_cwd(backend: Backend, sandbox: Sandbox) -> None:
    r = await sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=30)
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert not r.timed_out and not r.killed
    assert (await sandbox.exec(["true"], timeout=30)).exit_code == 0
    r = await sandbox.exec(["sh", "-c", 'echo "$A"; cat'], timeout=30, env={"A": "x"}, stdin=b"in")
    assert (r.exit_code, r.stdout) == (0, "x\nin")
    await sandbox.write_file("sub/mark.txt", b"here\n")
    r = await sandbox.exec(["cat", "mark.txt"], timeout=30, cwd=f"{backend.spec.workdir}/sub")
    assert (r.exit_code, r.stdout) == (0, "here\n")


async def test_a_timeout_kills_the_whole_tree(backend: Backend, sandbox: Sandbox) -> None:
    marker = _marker()
    script = f"(sleep {marker} &); sleep {marker} & sleep {marker}; echo no"
    started = time.monotonic()
    r = await sandbox.exec(["sh", "-c", script], timeout=1)
    elapsed = time.monotonic() - started
    assert r.timed_out and "no" not in r.stdout, r
    # The in-sandbox timeout ended it, before the host's own deadline would have.
    assert elapsed < shell.host_deadline(1), elapsed
    await _all_gone(backend, sandbox, marker)


# ---- files ----------------------------------------------------------------------------------


async def test_files_in_and_out(backend: Backend, sandbox: Sandbox) -> None:
    data = bytes(range(256)) * 1000
    await sandbox.write_file("deep/er/blob.bin", data)
    assert await sandbox.read_file(f"{backend.spec.workdir}/deep/er/blob.bin") == data
    r = await sandbox.exec(["wc", "-c", "deep/er/blob.bin"], timeout=30)
    assert r.stdout.split()[0] == str(len(data)), r
    await sandbox.exec(["sh", "-c", "printf made > made.txt"], timeout=30)
    assert await sandbox.read_file("made.txt") == b"made"
    with pytest.raises(SandboxError):
        await sandbox.read_file("missing.txt")


# ---- spawn ----------------------------------------------------------------------------------


async def test_spawn_talks_and_its_kill_ends_the_session(
    backend: Backend, sandbox: Sandbox
) -> None:
    marker = _marker()
    await sandbox.write_file("sub/mark.txt", b"here\n")
    proc = await sandbox.spawn(
        ["sh", "-c", f'cat mark.txt; echo "$X"; sleep {marker} & exec cat'],
        env={"X": "y"},
        cwd=f"{backend.spec.workdir}/sub",
    )
    assert [await proc.readline(), await proc.readline()] == [b"here\n", b"y\n"]
    await proc.write(b"ping\n")
    assert await proc.readline() == b"ping\n"
    await _appears(backend, sandbox, marker)
    await proc.kill()
    await proc.kill()  # idempotent
    # End of file, once nothing holds its stdout open any more (bounded: a kill that missed
    # the session would leave the background sleep holding it).
    assert await asyncio.wait_for(proc.readline(), 30) == b""
    with pytest.raises(SandboxError):
        await proc.write(b"more\n")
    await _all_gone(backend, sandbox, marker)


# ---- cancellation ---------------------------------------------------------------------------


async def test_a_cancelled_exec_raises_and_leaves_no_process(
    backend: Backend, sandbox: Sandbox
) -> None:
    marker = _marker()
    task = asyncio.ensure_future(sandbox.exec(["sh", "-c", f"sleep {marker}"], timeout=120))
    await _appears(backend, sandbox, marker)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _all_gone(backend, sandbox, marker)
    assert (await sandbox.exec(["true"], timeout=30)).exit_code == 0  # the sandbox lives on


# ---- close ----------------------------------------------------------------------------------


async def test_close_is_idempotent_and_ends_the_sandbox(backend: Backend) -> None:
    sb = await backend.provider.create(backend.spec)
    try:
        assert await sb.is_alive()
        assert sb.id in await backend.provider.list_owned()
    finally:
        await sb.close()
    await sb.close()
    assert not await sb.is_alive()
    assert sb.id not in await backend.provider.list_owned()
    with pytest.raises(SandboxError):
        await sb.exec(["true"], timeout=30)
