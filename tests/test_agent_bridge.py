"""The black-box agent bridge: :func:`corral.envs.agent_bridge.run_agent` in real sandboxes
(bwrap always, docker with the test daemon, the unisolated local backend), with a real HTTP
server on 127.0.0.1 standing as the gateway (an aiohttp app that records what it is asked:
the bridge is what is tested, not the gateway).

The agents are small python3 scripts passed as ``agent_dir`` files. Every test that runs an
agent ends by looking for its processes (each run's processes carry a marker in their
command line): none may be left, whatever the agent did (a child ignoring SIGTERM, a
grandchild in a session of its own).

Every sandbox has network ``none``: the agent reaches nothing but its own listener, which the
env server bridges to the gateway.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from corral.envs.agent_bridge import (
    MAX_FILES_BYTES,
    MAX_TRANSCRIPT_BYTES,
    AgentPolicy,
    AgentRefused,
    run_agent,
)
from corral.envs.bundle import load_bundle
from corral.envs.hosting import CODE_ROOT, build_payload
from corral.envs.protocol import (
    AGENT_DIR,
    AGENT_HOME,
    AGENT_ROOT,
    AGENT_TMP,
    GATEWAY_PLACEHOLDER,
    AgentFile,
    AgentLaunch,
)
from corral.sandboxes.base import (
    Bind,
    Sandbox,
    SandboxError,
    SandboxProvider,
    SandboxSpec,
)
from corral.sandboxes.bwrap import BwrapProvider
from corral.sandboxes.local import LocalProvider
from tests.conftest import ROOT, SANDBOX_IMAGE
from tests.servers import Gateway, free_port, stand_in_gateway

WORKDIR = "/work"

AGENT = r"""
import http.client, json, os, signal, subprocess, sys, time
from urllib.parse import urlsplit

mode, marker, gateway = sys.argv[1], sys.argv[2], sys.argv[3]
url = urlsplit(gateway)


def ask(path, body=None):
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=20)
    try:
        conn.request("POST" if body else "GET", path, body=body)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


if mode == "basic":
    first = ask("/v1/first", b'{"hello": "gateway"}')
    second = ask("/v1/second")
    with open("answer.txt", "w") as f:
        f.write(first + "|" + second)
    try:
        open(os.path.join(os.environ["CORRAL_AGENT_DIR"], "new.txt"), "w")
        agent_dir_writable = True
    except OSError:
        agent_dir_writable = False
    config = os.path.join(os.environ["HOME"], "conf", "settings.json")
    me = os.path.abspath(__file__)
    names = ("HOME", "TMPDIR", "CORRAL_AGENT_DIR", "PATH", "MINE")
    report = {
        "env": {k: os.environ.get(k) for k in names},
        "cwd": os.getcwd(),
        "uid": os.getuid(),
        "stdin": os.read(0, 10).decode(),
        "config": open(config).read(),
        "config_mode": oct(os.stat(config).st_mode & 0o777),
        "config_uid": os.stat(config).st_uid,
        "agent_mode": oct(os.stat(me).st_mode & 0o777),
        "agent_uid": os.stat(me).st_uid,
        "dir_mode": oct(os.stat(os.path.dirname(me)).st_mode & 0o777),
        "agent_dir_writable": agent_dir_writable,
        "tmp_writable": os.access(os.environ["TMPDIR"], os.W_OK),
        "replies": [first, second],
    }
    print(json.dumps(report), flush=True)
    print("to stderr", file=sys.stderr)
    sys.exit(3)
elif mode == "hang":
    if sys.argv[4:] == ["stubborn"]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]],"
        " start_new_session=True); time.sleep(600)"
    )
    subprocess.Popen([sys.executable, "-c", child, marker])
    time.sleep(0.5)  # the grandchild is started before the gateway hears of it
    ask("/v1/hanging")
    time.sleep(600)
elif mode == "flood":
    chunk = b"x" * 65535 + b"\n"
    for _ in range(int(sys.argv[4])):
        os.write(1, chunk)
    os.write(1, b"THE END")
elif mode == "once":
    try:
        print("answer:", ask("/v1/nobody"))
    except Exception as exc:
        print("failed:", type(exc).__name__, exc)
"""


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with stand_in_gateway() as gw:
        yield gw


@pytest.fixture(scope="module")
def payload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_payload(load_bundle(ROOT / "bundles" / "shellcraft"), tmp_path_factory.mktemp("p"))


@dataclass
class Box:
    """A live sandbox and what run_agent needs to know of it."""

    backend: str
    sandbox: Sandbox
    code_root: str
    jail: tuple[str, ...]

    async def run(self, launch: AgentLaunch, **policy: Any) -> Any:
        return await run_agent(
            self.sandbox,
            launch,
            python="python3",
            code_root=self.code_root,
            jail=self.jail,
            workdir=WORKDIR,
            policy=AgentPolicy(**policy),
        )

    async def agent_processes(self, marker: str) -> list[str]:
        """Command lines holding ``marker``: docker's from an exec in the container (its pid
        namespace holds them all), the others' from the host (bwrap's execs each get a pid
        namespace of their own; local is the host)."""
        if self.backend == "docker":
            script = (
                "import os,sys\nfor p in os.listdir('/proc'):\n if p.isdigit():\n  try:\n"
                "   c=open('/proc/'+p+'/cmdline','rb').read()\n  except OSError:\n   continue\n"
                "  if sys.argv[1].encode() in c and b'import os,sys' not in c: print(p, c)\n"
            )
            out = await self.sandbox.exec(["python3", "-c", script, marker], timeout=20)
            return out.stdout.splitlines()
        return await asyncio.to_thread(_host_processes, marker)


def _launcher_of(marker: str) -> int:
    """The pid of the launcher above the agent process whose command line holds ``marker``."""
    agent = next(
        int(pid)
        for pid in os.listdir("/proc")
        if pid.isdigit() and _cmdline(int(pid)).find(marker.encode() + b"\0http") > 0
    )
    pid = agent
    while pid > 1:
        pid = int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        if b"corral.envs.agent_launcher" in _cmdline(pid):
            return pid
    raise AssertionError(f"no launcher above {agent}")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _host_processes(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != str(os.getpid()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(f"{pid} {cmdline!r}")
    return found


BACKENDS = ["bwrap", "local", "docker"]


@pytest.fixture(params=BACKENDS)
async def box(request: pytest.FixtureRequest, payload: Path, tmp_path: Path) -> AsyncIterator[Box]:
    backend: str = request.param
    owner = f"agent-bridge-{uuid.uuid4().hex[:6]}"
    provider: SandboxProvider
    binds = (Bind(source=payload, target=CODE_ROOT),)
    if backend == "bwrap":
        if shutil.which("bwrap") is None:
            pytest.skip("bubblewrap is not installed")
        provider = BwrapProvider(owner, tmp_path / "state")
        spec = SandboxSpec(workdir=WORKDIR, binds=binds)
        code_root = CODE_ROOT
    elif backend == "local":
        provider = LocalProvider(owner, tmp_path / "state")
        spec = SandboxSpec(workdir=WORKDIR)
        code_root = str(payload)
    else:
        request.getfixturevalue("docker_daemon")
        from corral.sandboxes.docker import DockerProvider

        provider = DockerProvider(owner, image=SANDBOX_IMAGE)
        spec = SandboxSpec(workdir=WORKDIR, binds=binds)
        code_root = CODE_ROOT
    sandbox = await provider.create(spec)
    try:
        yield Box(backend, sandbox, code_root, provider.model_jail(spec))
    finally:
        await sandbox.close()
        assert await provider.list_owned() == []


def _file(path: str, content: bytes, area: str = "agent_dir", **kw: Any) -> AgentFile:
    return AgentFile(area=area, path=path, content_b64=base64.b64encode(content).decode(), **kw)  # type: ignore[arg-type]


def _launch(gateway: str, mode: str, marker: str, *extra: str, **fields: Any) -> AgentLaunch:
    files = [_file("agent.py", AGENT.encode()), *fields.pop("files", [])]
    return AgentLaunch(
        harness="command",
        argv=["python3", f"{AGENT_DIR}/agent.py", mode, marker, GATEWAY_PLACEHOLDER, *extra],
        env=fields.pop("env", {}),
        files=files,
        gateway=gateway,
        **{"timeout_s": 60.0, **fields},
    )


def _marker() -> str:
    return f"corral-h1-{uuid.uuid4().hex[:10]}"


async def test_an_agent_reaches_the_gateway_and_works_in_the_workspace(
    box: Box, gateway: Gateway
) -> None:
    marker = _marker()
    config = f'{{"base_url": "{GATEWAY_PLACEHOLDER}/v1"}}'.encode()
    launch = _launch(
        gateway.origin,
        "basic",
        marker,
        env={"MINE": f"{GATEWAY_PLACEHOLDER}/x", "HOME": "/ignored"},
        files=[_file("conf/settings.json", config, area="home")],
    )
    run = await box.run(launch, path_dirs=("/opt/agent-bin",))

    assert run.exit_code == 3, run
    assert not run.timed_out and run.killed_reason is None
    assert [(m, p) for m, p, _ in gateway.requests] == [
        ("POST", "/v1/first"),
        ("GET", "/v1/second"),
    ]
    assert gateway.requests[0][2] == b'{"hello": "gateway"}'
    assert run.gateway_connections == 2
    assert run.started_s is not None and run.first_request_s is not None
    assert run.started_s <= run.first_request_s <= run.seconds
    assert run.stderr_tail.strip() == "to stderr"
    report = json.loads(run.transcript)
    assert run.stdout_tail == run.transcript
    assert report["replies"] == ["reply to /v1/first", "reply to /v1/second"]
    origin = report["env"]["MINE"].removesuffix("/x")
    assert origin.startswith("http://127.0.0.1:") and origin != gateway.origin
    assert report["config"] == f'{{"base_url": "{origin}/v1"}}'
    assert report["env"]["HOME"] == AGENT_HOME
    assert report["env"]["TMPDIR"] == AGENT_TMP
    assert report["env"]["CORRAL_AGENT_DIR"] == AGENT_DIR
    assert report["env"]["PATH"] == "/opt/agent-bin:/usr/local/bin:/usr/bin:/bin"
    assert report["stdin"] == ""
    assert report["agent_dir_writable"] is False and report["tmp_writable"] is True
    assert (report["agent_mode"], report["dir_mode"]) == ("0o444", "0o555")
    assert report["config_mode"] == "0o600"
    assert report["agent_uid"] == report["config_uid"] == report["uid"]

    answer = await box.sandbox.read_file(f"{WORKDIR}/answer.txt")
    assert answer == b"reply to /v1/first|reply to /v1/second"
    owner = await box.sandbox.exec(["stat", "-c", "%u", "answer.txt"], timeout=20)
    assert int(owner.stdout) == report["uid"]
    if box.backend == "docker":
        assert report["uid"] == 1000
    elif box.backend == "local" and os.geteuid() == 0:
        assert report["uid"] == 65534
    local = box.backend == "local"
    assert report["cwd"] == (str(box.sandbox.folder) if local else WORKDIR)  # type: ignore[attr-defined]
    # The agent's folders (its configs hold the session's key) are gone once it has ended.
    gone = await box.sandbox.exec(
        ["python3", "-c", f"import os; print(os.path.lexists({AGENT_ROOT!r}))"], timeout=20
    )
    assert gone.stdout.strip() == "False"
    assert await box.agent_processes(marker) == []


async def test_an_overrun_kills_every_process_of_the_agent(box: Box, gateway: Gateway) -> None:
    marker = _marker()
    run = await box.run(_launch(gateway.origin, "hang", marker, timeout_s=3.0, kill_grace_s=1.0))
    assert run.timed_out and run.exit_code is None, run
    assert 3.0 <= run.seconds < 3.0 + 1.0 + 8.0
    assert [p for _, p, _ in gateway.requests] == ["/v1/hanging"]
    assert await box.agent_processes(marker) == []


async def test_an_agent_that_ignores_sigterm_is_killed_after_the_grace(
    box: Box, gateway: Gateway
) -> None:
    marker = _marker()
    launch = _launch(gateway.origin, "hang", marker, "stubborn", timeout_s=2.0, kill_grace_s=1.5)
    run = await box.run(launch)
    assert run.timed_out and run.exit_code is None, run
    if box.backend != "bwrap":  # bwrap's jail ends its whole namespace at the SIGTERM
        assert run.seconds >= 2.0 + 1.5
    assert await box.agent_processes(marker) == []


async def test_a_launcher_killed_outright_is_a_run_that_says_so(box: Box, gateway: Gateway) -> None:
    """bwrap: the launcher is its namespace's pid 1, so everything dies with it. local: the
    agent's own process dies with it (a parent-death signal); what the agent started is
    not reached (no isolation: nothing holds the tree), so the test kills it itself. docker:
    the launcher (killed here from the host, as an OOM kill would) takes nothing with it:
    the agent's processes live until the container goes, at the episode's close (the run
    says the launcher was killed, so the rollout is failed, whatever the agent does)."""
    marker = _marker()
    task = asyncio.ensure_future(box.run(_launch(gateway.origin, "hang", marker)))
    await asyncio.wait_for(gateway.hanging.wait(), 30)
    launcher = await asyncio.to_thread(_launcher_of, marker)
    os.kill(launcher, signal.SIGKILL)
    run = await asyncio.wait_for(task, 30)
    assert run.exit_code is None and not run.timed_out, run
    assert run.killed_reason is not None and "launcher" in run.killed_reason
    left = await box.agent_processes(marker)
    if box.backend == "local":
        assert not [p for p in left if "agent.py" in p]
        for entry in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.split()[0]), signal.SIGKILL)
    elif box.backend == "docker":
        await box.sandbox.close()
        assert not await box.sandbox.is_alive()
        assert await asyncio.to_thread(_host_processes, marker) == []
    else:
        assert left == []


async def test_a_sandbox_gone_under_the_agent_is_a_sandbox_error(
    box: Box, gateway: Gateway
) -> None:
    marker = _marker()
    task = asyncio.ensure_future(box.run(_launch(gateway.origin, "hang", marker)))
    await asyncio.wait_for(gateway.hanging.wait(), 30)
    await box.sandbox.close()
    with pytest.raises(SandboxError, match="gone"):
        await asyncio.wait_for(task, 30)
    if box.backend == "local":  # no isolation: what the agent started outlives its sandbox
        for entry in await box.agent_processes(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.split()[0]), signal.SIGKILL)
    elif box.backend == "bwrap":
        assert await box.agent_processes(marker) == []


async def test_a_stdout_flood_is_bounded(box: Box, gateway: Gateway) -> None:
    chunks = (MAX_TRANSCRIPT_BYTES // 65536) * 3  # three times the transcript's bound
    run = await box.run(_launch(gateway.origin, "flood", _marker(), str(chunks)))
    assert run.exit_code == 0, run
    assert run.transcript_truncated
    assert len(run.transcript) == MAX_TRANSCRIPT_BYTES
    assert run.stdout_tail.endswith("x\nTHE END") and len(run.stdout_tail) == 4000


async def test_a_gateway_that_is_down_resets_the_agents_connection(box: Box) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    run = await box.run(_launch(down, "once", _marker()))
    assert run.exit_code == 0, run
    assert run.transcript.startswith("failed:"), run.transcript
    assert run.gateway_connections == 1


async def test_cancellation_leaves_no_process(box: Box, gateway: Gateway) -> None:
    marker = _marker()
    task = asyncio.ensure_future(box.run(_launch(gateway.origin, "hang", marker)))
    await asyncio.wait_for(gateway.hanging.wait(), 30)
    assert await box.agent_processes(marker) != []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await box.agent_processes(marker) == []


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"gateway": "http://10.1.2.3:8000"}, "not a loopback origin"),
        ({"gateway": "ftp://127.0.0.1:21"}, "only http and https"),
        ({"gateway": "http://127.0.0.1:8000/v1"}, "no path"),
        ({"timeout_s": 7200.0}, "over this server's cap"),
        ({"files": [_file("../escape.py", b"x")]}, "without '..'"),
        ({"files": [_file("/etc/passwd", b"x", area="home")]}, "without '..'"),
        ({"files": "huge"}, "over"),
        ({"env": {"BAD=NAME": "x"}}, "not a variable name"),
    ],
)
async def test_refused_launches_start_nothing(
    change: dict[str, Any], why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = LocalProvider("agent-bridge-refusals", tmp_path)
    sandbox = await provider.create(SandboxSpec())

    async def no_spawn(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a refused launch started something")

    monkeypatch.setattr(sandbox, "spawn", no_spawn)
    fields: dict[str, Any] = {"argv": ["true"], "gateway": "http://127.0.0.1:8000"}
    if change.get("files") == "huge":  # built here, not at collection: 43 MB of base64
        change = {"files": [_file("big.bin", b"\0" * (MAX_FILES_BYTES // 2 + 1))] * 2}
        change["files"][1] = _file("big2.bin", b"\0" * (MAX_FILES_BYTES // 2))
    fields |= {"timeout_s": 10.0} | change
    launch = AgentLaunch(harness="command", **fields)
    try:
        with pytest.raises(AgentRefused, match=why):
            await run_agent(
                sandbox, launch, python=sys.executable, code_root="/nonexistent",
                jail=(), workdir="/work", policy=AgentPolicy(),
            )  # fmt: skip
    finally:
        await sandbox.close()


async def test_a_named_gateway_is_allowed_and_others_are_not(tmp_path: Path) -> None:
    provider = LocalProvider("agent-bridge-policy", tmp_path)
    async with await provider.create(SandboxSpec()) as sandbox:
        launch = AgentLaunch(harness="x", argv=["true"], gateway="https://127.0.0.1", timeout_s=1)
        policy = AgentPolicy(gateways=("https://gw.example:443",))
        with pytest.raises(AgentRefused, match="not one this server bridges to"):
            await run_agent(
                sandbox, launch, python=sys.executable, code_root="/x", jail=(),
                workdir="/work", policy=policy,
            )  # fmt: skip


async def test_an_https_gateway_is_reached_over_tls(
    payload: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bridge's side speaks TLS to an ``https`` gateway, checking its certificate (here a
    self-signed one for 127.0.0.1, made trusted through ``SSL_CERT_FILE``); the agent speaks
    plain HTTP to its listener. One backend is enough: the sandbox side is the same."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = await asyncio.to_thread(
        subprocess.run,
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        capture_output=True,
        check=False,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"openssl cannot make a certificate: {made.stderr[-300:]!r}")
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(text=f"tls reply to {request.path}")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    provider = LocalProvider("agent-bridge-tls", tmp_path / "state")
    try:
        async with await provider.create(SandboxSpec(workdir=WORKDIR)) as sandbox:
            box = Box("local", sandbox, str(payload), provider.model_jail(SandboxSpec()))
            launch = _launch(f"https://127.0.0.1:{port}", "once", _marker())
            untrusted = await box.run(launch)
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            trusted = await box.run(launch)
    finally:
        await runner.cleanup()
    assert untrusted.transcript.startswith("failed:"), untrusted  # the certificate is checked
    assert trusted.exit_code == 0 and trusted.transcript == "answer: tls reply to /v1/nobody\n"
    assert seen == ["/v1/nobody"]
