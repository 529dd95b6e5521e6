"""Black-box agents in the remote backends (kubernetes, e2b), through their stand-ins.

Neither a Kubernetes cluster nor E2B's service can be reached from here, so the sandboxes come
from the two STAND-INS the backends' own tests use (test code speaking the real APIs over HTTP
on 127.0.0.1, driven by the real ``kubernetes`` client and ``e2b`` SDK): Pods of
:mod:`tests.k8s_standin` run as bwrap sandboxes (their own pid and network namespaces, the
host's ``/usr``, so ``python3`` is there), sandboxes of :class:`tests.test_sandbox_e2b.StandIn`
run commands as this host's processes (so their working and upload folders are temporary ones
here, and the agent's folders are the host's ``/tmp/corral-agent``: as under the local
backend, one agent at a time per host).

What runs is the env server's own path: a :class:`~corral.envs.hosting.SandboxHost` uploads the
payload (the launcher beside the runner) into each sandbox, and the episode's handle runs the
launch (:func:`corral.envs.agent_bridge.run_agent`): the launcher spawned over the backend's
exec stream (a WebSocket for kubernetes, envd's Connect stream for e2b), the agent's TCP
connections bridged over that stream's stdin/stdout to a real HTTP server on 127.0.0.1 standing
as the gateway. The sandboxes have network ``none``: the agent reaches nothing but its own
listener. Every test that runs an agent ends by looking for its processes from inside the
sandbox (each run's processes carry a marker in their command line): none may be left.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral.envs.bundle import Bundle, load_bundle
from corral.envs.hosting import UPLOAD_ROOT, SandboxedEnv, SandboxHost
from corral.envs.protocol import AGENT_DIR, AGENT_ROOT, GATEWAY_PLACEHOLDER, AgentFile, AgentLaunch
from corral.sandboxes.base import SandboxProvider, SandboxSpec
from corral.sandboxes.image import DEFAULT_TAG
from tests.conftest import ROOT
from tests.servers import Gateway, stand_in_gateway

SHELLCRAFT = ROOT / "bundles" / "shellcraft"
BIG = 3 * 2**20 + 17  # bytes each way in the big-transfer test: many frames, odd-sized

pytestmark = pytest.mark.timeout(240)

AGENT = r"""
import hashlib, http.client, json, os, subprocess, sys, time
from urllib.parse import urlsplit

mode, marker, gateway = sys.argv[1], sys.argv[2], sys.argv[3]
url = urlsplit(gateway)


def ask(path, body=None):
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request("POST" if body is not None else "GET", path, body=body)
        return conn.getresponse().read()
    finally:
        conn.close()


if mode == "work":
    reply = ask("/v1/hello", b'{"from": "agent"}').decode()
    with open("agent-note.txt", "w") as f:
        f.write(reply)
    print(json.dumps({"cwd": os.getcwd(), "reply": reply, "home": os.environ["HOME"]}))
elif mode == "big":
    sent = bytes(range(256)) * (int(sys.argv[4]) // 256) + b"z" * (int(sys.argv[4]) % 256)
    echoed = ask("/v1/echo", sent)
    with open("digest.txt", "w") as f:
        f.write(hashlib.sha256(echoed).hexdigest())
    print(len(echoed), hashlib.sha256(sent).hexdigest())
elif mode == "many":
    import threading

    n, size = int(sys.argv[4]), int(sys.argv[5])
    results = {}

    def one(i):
        body = bytes([65 + i]) * size
        results[i] = ask(f"/v1/echo/{i}", body) == body[::-1]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(sorted(i for i, ok in results.items() if ok)))
elif mode == "hang":
    child = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]],"
        " start_new_session=True); time.sleep(600)"
    )
    subprocess.Popen([sys.executable, "-c", child, marker])
    time.sleep(0.5)  # the grandchild is started before the gateway hears of it
    ask("/v1/hanging")
    time.sleep(600)
"""

# Lists the processes whose command line holds argv[1] (run inside the sandbox: a Pod's execs
# share its pid namespace; the e2b stand-in's processes are this host's).
FIND = (
    "import os, sys\n"
    "for p in os.listdir('/proc'):\n"
    "    if p.isdigit() and int(p) != os.getpid():\n"
    "        try:\n"
    "            c = open('/proc/' + p + '/cmdline', 'rb').read()\n"
    "        except OSError:\n"
    "            continue\n"
    "        if sys.argv[1].encode() in c and b'FIND-MARK' not in c:\n"
    "            print(p, c)\n"
)

# SIGKILLs the launcher above the agent whose command line holds argv[1] (and no other).
KILL_LAUNCHER = (
    "import os, signal, sys\n"
    "def cmd(p):\n"
    "    try:\n"
    "        return open(f'/proc/{p}/cmdline', 'rb').read()\n"
    "    except OSError:\n"
    "        return b''\n"
    "def parent(p):\n"
    "    return int(open(f'/proc/{p}/stat', 'rb').read().rsplit(b')', 1)[1].split()[1])\n"
    "mark = sys.argv[1].encode() + b'\\0http'\n"
    "agent = next(int(p) for p in os.listdir('/proc') if p.isdigit() and mark in cmd(p))\n"
    "p = agent\n"
    "while b'corral.envs.agent_launcher' not in cmd(p):\n"
    "    p = parent(p)\n"
    "os.kill(p, signal.SIGKILL)\n"
)


# -- the gateway -------------------------------------------------------------------------------


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with stand_in_gateway(max_body_bytes=64 * 2**20) as gw:
        yield gw


# -- the remote backends -----------------------------------------------------------------------


@dataclass
class Remote:
    """A remote backend's provider, the spec of its sandboxes and where payloads go."""

    backend: str
    provider: SandboxProvider
    spec: SandboxSpec
    upload_root: str

    def host(self, bundle: Bundle) -> SandboxHost:
        return SandboxHost(bundle, self.provider, self.spec, upload_root=self.upload_root)


@pytest.fixture(scope="module")
def k8s_standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError):
        pytest.skip("the kubernetes stand-in runs Pods in bwrap: pip install pyseccomp")
    if shutil.which("bwrap") is None:
        pytest.skip("the kubernetes stand-in runs Pods in bwrap: apt-get install bubblewrap")
    from tests.k8s_standin import StandIn

    standin = StandIn(tmp_path_factory.mktemp("k8s-standin"), images=(DEFAULT_TAG,))
    standin.start()
    yield standin
    standin.stop()


@pytest.fixture(params=["kubernetes", "e2b"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    owner = f"agent-remote-{uuid.uuid4().hex[:8]}"
    if request.param == "kubernetes":
        from kubernetes import client as k8s

        from corral.sandboxes.kubernetes import KubernetesProvider

        standin = request.getfixturevalue("k8s_standin")
        api = k8s.ApiClient(k8s.Configuration(host=standin.url))
        provider = KubernetesProvider(owner, image=DEFAULT_TAG, api_client=api, start_timeout=60)
        yield Remote("kubernetes", provider, SandboxSpec(workdir="/work", ttl_s=600), UPLOAD_ROOT)
        assert standin.unexpected == [], "the backend made a call the stand-in lacks"
        return
    pytest.importorskip("e2b", reason="the e2b SDK is not installed (pip install 'corral[e2b]')")
    from tests.servers import serve
    from tests.test_sandbox_e2b import StandIn as E2BStandIn
    from tests.test_sandbox_e2b import make_provider

    service = E2BStandIn(tmp_path / "e2b")
    with serve(service) as url:
        service.url = url
        try:
            # The stand-in's sandboxes are this host's processes: their folders are ours.
            spec = SandboxSpec(workdir=str(tmp_path / "work"), ttl_s=600)
            yield Remote("e2b", make_provider(service), spec, str(tmp_path / "code"))
        finally:
            for sid in list(service.sandboxes):
                service.kill_now(sid)


@pytest.fixture
async def episode(remote: Remote) -> AsyncIterator[SandboxedEnv]:
    """A shellcraft env in a fresh remote sandbox, its payload uploaded; removed afterwards."""
    host = remote.host(load_bundle(SHELLCRAFT))
    await host.open()
    try:
        env = await host.start()
        assert isinstance(env, SandboxedEnv)
        try:
            yield env
        finally:
            await env.close()
    finally:
        await host.aclose()
    assert await remote.provider.list_owned() == []


def _file(path: str, content: bytes) -> AgentFile:
    return AgentFile(area="agent_dir", path=path, content_b64=base64.b64encode(content).decode())


def _launch(gateway: str, mode: str, marker: str, *extra: str, **fields: Any) -> AgentLaunch:
    return AgentLaunch(
        harness="command",
        argv=["python3", f"{AGENT_DIR}/agent.py", mode, marker, GATEWAY_PLACEHOLDER, *extra],
        files=[_file("agent.py", AGENT.encode())],
        gateway=gateway,
        **{"timeout_s": 60.0, **fields},
    )


def _marker() -> str:
    return f"corral-remote-{uuid.uuid4().hex[:10]}"


async def _processes(env: SandboxedEnv, marker: str) -> list[str]:
    found = await env.sandbox.exec(["python3", "-c", FIND, marker, "FIND-MARK"], timeout=30)
    assert found.exit_code == 0, found
    return found.stdout.splitlines()


def _workdir(remote: Remote, name: str) -> str:
    return f"{remote.spec.workdir}/{name}"


# -- the agent in the sandbox ------------------------------------------------------------------


async def test_an_agent_reaches_the_gateway_and_writes_in_the_workspace(
    remote: Remote, episode: SandboxedEnv, gateway: Gateway
) -> None:
    marker = _marker()
    run = await episode.run_agent(_launch(gateway.origin, "work", marker))
    assert run.exit_code == 0 and not run.timed_out and run.killed_reason is None, run
    assert gateway.requests == [("POST", "/v1/hello", b'{"from": "agent"}')]
    assert run.gateway_connections == 1
    report = json.loads(run.transcript)
    assert report["reply"] == "reply to /v1/hello"
    assert report["cwd"] == remote.spec.workdir
    assert report["home"].startswith(AGENT_ROOT)
    note = await episode.sandbox.read_file(_workdir(remote, "agent-note.txt"))
    assert note == b"reply to /v1/hello"
    # The agent's folders (a real agent's configs hold the session's key) are gone.
    gone = await episode.sandbox.exec(
        ["python3", "-c", f"import os; print(os.path.lexists({AGENT_ROOT!r}))"], timeout=30
    )
    assert gone.stdout.strip() == "False"
    assert await _processes(episode, marker) == []


async def test_megabytes_cross_the_bridge_both_ways(
    remote: Remote, episode: SandboxedEnv, gateway: Gateway
) -> None:
    """A request body and a reply of 3 MiB each: dozens of 64 KiB frames down the spawn's
    stdin and up its stdout, in order and whole."""
    run = await episode.run_agent(_launch(gateway.origin, "big", _marker(), str(BIG)))
    assert run.exit_code == 0, run
    [(method, path, body)] = gateway.requests
    assert (method, path, len(body)) == ("POST", "/v1/echo", BIG)
    sent_digest = hashlib.sha256(body).hexdigest()
    assert run.transcript.split() == [str(BIG), sent_digest]
    digest = await episode.sandbox.read_file(_workdir(remote, "digest.txt"))
    assert digest.decode() == hashlib.sha256(body[::-1]).hexdigest()


async def test_concurrent_connections_are_kept_apart(
    remote: Remote, episode: SandboxedEnv, gateway: Gateway, request: pytest.FixtureRequest
) -> None:
    """Eight connections at once, 256 KiB each way: their frames interleave on the one
    stream and each reply reaches its own connection whole. On kubernetes the exec stream is
    ``v4.channel.k8s.io`` here (no stdin close: the launcher's stdin never needs one)."""
    if remote.backend == "kubernetes":
        from tests.k8s_standin import V4, V5

        standin = request.getfixturevalue("k8s_standin")
        standin.protocols = (V4,)
    try:
        run = await episode.run_agent(_launch(gateway.origin, "many", _marker(), "8", "262144"))
    finally:
        if remote.backend == "kubernetes":
            standin.protocols = (V5, V4)
    assert run.exit_code == 0, run
    assert json.loads(run.transcript) == list(range(8))
    assert run.gateway_connections == 8
    assert sorted(p for _, p, _ in gateway.requests) == [f"/v1/echo/{i}" for i in range(8)]
    if remote.backend == "kubernetes":
        launchers = [v for argv, v in standin.execs if "corral.envs.agent_launcher" in argv]
        assert launchers[-1] == V4


async def test_an_overrun_kills_every_process_of_the_agent(
    episode: SandboxedEnv, gateway: Gateway
) -> None:
    """Past its budget the agent gets SIGTERM; its child ignores it and a grandchild is in a
    session of its own: the launcher's kill finds and ends them all."""
    marker = _marker()
    launch = _launch(gateway.origin, "hang", marker, timeout_s=3.0, kill_grace_s=1.0)
    run = await episode.run_agent(launch)
    assert run.timed_out and run.exit_code is None, run
    assert 3.0 <= run.seconds < 3.0 + 1.0 + 10.0
    assert [p for _, p, _ in gateway.requests] == ["/v1/hanging"]
    assert await _processes(episode, marker) == []
    # The sandbox lives on: the episode's env still answers.
    assert (await episode.sandbox.exec(["true"], timeout=30)).exit_code == 0


async def test_a_cancelled_run_leaves_no_process(episode: SandboxedEnv, gateway: Gateway) -> None:
    marker = _marker()
    task = asyncio.ensure_future(episode.run_agent(_launch(gateway.origin, "hang", marker)))
    await asyncio.wait_for(gateway.hanging.wait(), 60)
    assert await _processes(episode, marker) != []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _processes(episode, marker) == []


async def test_a_launcher_killed_outright_is_a_run_that_says_so(
    remote: Remote, gateway: Gateway
) -> None:
    """The launcher SIGKILLed from inside (the agent's uid may: the jail is empty on both):
    the run ends saying so, the agent's own process dies with it (a parent-death signal),
    the backend's spawn kill ends the rest of the launcher's session; a grandchild in a
    session of its own is reached by nothing but the sandbox's end, which closing the
    episode brings. (The stand-ins' processes are this host's: the last look is from here.)"""
    from tests.test_agent_bridge import _host_processes

    marker = _marker()
    host = remote.host(load_bundle(SHELLCRAFT))
    await host.open()
    try:
        env = await host.start()
        assert isinstance(env, SandboxedEnv)
        try:
            task = asyncio.ensure_future(env.run_agent(_launch(gateway.origin, "hang", marker)))
            await asyncio.wait_for(gateway.hanging.wait(), 60)
            killed = await env.sandbox.exec(["python3", "-c", KILL_LAUNCHER, marker], timeout=30)
            assert killed.exit_code == 0, killed
            run = await asyncio.wait_for(task, 60)
            assert run.exit_code is None and not run.timed_out, run
            assert run.killed_reason is not None and "launcher" in run.killed_reason
            left = await _processes(env, marker)
            assert not [p for p in left if "agent.py" in p], left
            assert len(left) == 1, left  # the grandchild in a session of its own
        finally:
            await env.close()
    finally:
        await host.aclose()
    if remote.backend == "e2b":
        # The stand-in ends a "sandbox" by killing the processes whose environment carries its
        # marker, and the launcher gives the agent an environment of its own: the escaped
        # grandchild is out of the stand-in's reach (a real VM's end takes everything). This
        # test started it; it ends it by its pid.
        for entry in await asyncio.to_thread(_host_processes, marker):
            assert "time.sleep(600)" in entry, entry
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.split()[0]), signal.SIGKILL)
        return
    for _ in range(100):  # SIGKILL delivery is asynchronous
        if not await asyncio.to_thread(_host_processes, marker):
            break
        await asyncio.sleep(0.05)
    assert await asyncio.to_thread(_host_processes, marker) == []


# -- a shellcraft task solved by an agent, graded ----------------------------------------------


def solving_script(commands: list[str]) -> str:
    """An agent running shellcraft's reference commands with bash in its working folder."""
    return (
        "import json, subprocess\n"
        f"for command in json.loads({json.dumps(json.dumps(commands))}):\n"
        "    subprocess.run(['bash', '-c', command], check=True)\n"
        "print('solved')\n"
    )


async def test_an_agent_solves_a_shellcraft_task_and_it_grades(
    remote: Remote, gateway: Gateway
) -> None:
    """The episode's path on the server: reset writes the task's files, the agent works in
    that folder, the finish tool ends it, the server grades the state (1.0)."""
    from bundles.shellcraft.solver import solve

    bundle = load_bundle(SHELLCRAFT)
    task = bundle.task("eval", 0)
    host = remote.host(bundle)
    await host.open()
    try:
        env = await host.start()
        try:
            await env.reset(task)
            script = solving_script(solve(task.data))
            launch = AgentLaunch(
                harness="command",
                argv=["python3", f"{AGENT_DIR}/agent.py"],
                files=[_file("agent.py", script.encode())],
                gateway=gateway.origin,
                timeout_s=120.0,
            )
            run = await env.run_agent(launch)
            assert run.exit_code == 0 and "solved" in run.transcript, run
            agent = bundle.manifest.agent
            assert agent is not None and agent.finish_tool is not None
            out = await env.call_tool(agent.finish_tool, {})
            assert out.done and not out.error, out
            scores = bundle.grade(task, await env.state())
        finally:
            await env.close()
    finally:
        await host.aclose()
    assert scores["correct"] == 1.0 and bundle.reward(scores) == pytest.approx(1.0)
    assert await remote.provider.list_owned() == []


async def test_the_env_server_runs_an_agent_in_a_pod(k8s_standin: Any, gateway: Gateway) -> None:
    """``corral serve --sandbox kubernetes``: the ``agent`` frame on the socket, the agent in
    the episode's Pod reaching the gateway, the episode graded by the server."""
    from kubernetes import client as k8s

    from bundles.shellcraft.solver import solve
    from corral.envs.client import EnvClient
    from corral.envs.server import build_app
    from corral.sandboxes.kubernetes import KubernetesProvider
    from tests.servers import serve

    api = k8s.ApiClient(k8s.Configuration(host=k8s_standin.url))
    provider = KubernetesProvider(
        f"agent-remote-{uuid.uuid4().hex[:8]}", image=DEFAULT_TAG, api_client=api
    )
    bundle = load_bundle(SHELLCRAFT)
    task = bundle.task("eval", 1)
    # The agent asks the gateway once, then solves the task.
    script = (
        "import http.client, sys\n"
        f"host, port = {GATEWAY_PLACEHOLDER!r}.removeprefix('http://').split(':')\n"
        "conn = http.client.HTTPConnection(host, int(port), timeout=30)\n"
        "conn.request('GET', '/v1/models')\n"
        "print(conn.getresponse().read().decode())\n"
    ) + solving_script(solve(task.data))
    launch = AgentLaunch(
        harness="command",
        argv=["python3", f"{AGENT_DIR}/agent.py"],
        files=[_file("agent.py", script.encode())],
        gateway=gateway.origin,
        timeout_s=120.0,
    )
    with serve(build_app(bundle, sandbox=provider)) as url:
        async with EnvClient(url) as env:
            await env.reset(task_id=task.id)
            result = await env.run_agent(launch)
    assert result.run.exit_code == 0, result.run
    assert "reply to /v1/models" in result.run.transcript and "solved" in result.run.transcript
    assert result.status == "graded" and result.reward == pytest.approx(1.0)
    assert [p for _, p, _ in gateway.requests] == ["/v1/models"]
    assert await provider.list_owned() == []
    assert k8s_standin.unexpected == []
