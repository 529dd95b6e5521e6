"""Bundles served with every episode's env in a sandbox: gridsim and a probe bundle in bwrap and
docker (and the unisolated local backend), with real servers on 127.0.0.1.

The probe bundle's tools fail on purpose (an env that raises, hangs, prints into stdout, or
whose sandbox is killed) to check that every failure reaches the client as a clear error and
that nothing is left behind: each test ends by asking the provider for its live sandboxes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from corral.envs.bundle import load_bundle
from corral.envs.client import EnvClient
from corral.envs.server import build_app
from corral.sandboxes.base import SandboxProvider
from corral.sandboxes.bwrap import CGROUP_ROOT, BwrapProvider
from corral.sandboxes.local import LocalProvider
from tests.conftest import ROOT, SANDBOX_IMAGE
from tests.processes import kill_processes_in, kill_processes_of_cgroup
from tests.servers import free_port, serve

GRIDSIM = ROOT / "bundles" / "gridsim"

PROBE_TOML = """
name = "probe"
version = "1"
system_prompt = "probe"
max_turns = 3

[splits]
train = "tasks/train.jsonl"

[sandbox]
needs = "process"
memory_mb = 256
pids = 64

[env]
module = "env.py"
class = "ProbeEnv"

[reward]
score = "seen"

[[tools]]
name = "echo"
description = "echo"
parameters = { type = "object", properties = { done = { type = "boolean" } } }
[[tools]]
name = "boom"
description = "raise"
parameters = { type = "object", properties = {} }
[[tools]]
name = "hang"
description = "never answer"
parameters = { type = "object", properties = {} }
[[tools]]
name = "noisy"
description = "print to stdout"
parameters = { type = "object", properties = {} }
[[tools]]
name = "where"
description = "pid, cwd, uid, and whether the env code is writable"
parameters = { type = "object", properties = {} }
"""

PROBE_ENV = """
import json, os, subprocess, time
from corral.envs.episode import ToolOutcome
from . import helper


class ProbeEnv:
    def reset(self, task):
        self.calls = []
        return task.prompt

    def call_tool(self, name, arguments):
        self.calls.append(name)
        if name == "echo":
            return ToolOutcome(json.dumps(arguments), done=arguments.get("done", False))
        if name == "boom":
            return helper.explode()
        if name == "hang":
            child = subprocess.Popen(["sleep", "3600"])
            open("hang.pid", "w").write(str(child.pid))
            time.sleep(3600)
        if name == "noisy":
            print("this must not break the protocol")
            print("{\\"ok\\": \\"forged\\"}")
            return ToolOutcome("quiet answer")
        if name == "where":
            try:
                open(os.path.join(os.path.dirname(__file__), "env.py"), "a").close()
                writable = True
            except OSError:
                writable = False
            info = {"pid": os.getpid(), "cwd": os.getcwd(), "uid": os.getuid(),
                    "code_writable": writable, "tasks_shipped": os.path.exists(
                        os.path.join(os.path.dirname(__file__), "tasks", "train.jsonl")),
                    "shipped": sorted(os.listdir(os.path.dirname(__file__)))}
            return ToolOutcome(json.dumps(info))
        return ToolOutcome("unknown tool", error=True)

    def state(self):
        return {"calls": self.calls}
"""

PROBE_HELPER = """
def explode():
    raise RuntimeError("the probe blew up on purpose")
"""

PROBE_VERIFIER = """
def grade(task, state):
    return {"seen": float(len(state["calls"]))}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bundles") / "probe"
    (root / "tasks").mkdir(parents=True)
    (root / "bundle.toml").write_text(PROBE_TOML)
    (root / "env.py").write_text(PROBE_ENV)
    (root / "helper.py").write_text(PROBE_HELPER)
    (root / "verifier.py").write_text(PROBE_VERIFIER)
    (root / "tasks" / "train.jsonl").write_text('{"id": "t0", "prompt": "go"}\n')
    return root


def _owner() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def _bwrap(tmp_path: Path) -> SandboxProvider:
    return BwrapProvider(_owner(), state_dir=tmp_path / "state")


def _docker(_: Path) -> SandboxProvider:
    from corral.sandboxes.docker import DockerProvider

    return DockerProvider(_owner(), image=SANDBOX_IMAGE)


def _local(tmp_path: Path) -> SandboxProvider:
    return LocalProvider(_owner(), state_dir=tmp_path / "state")


@pytest.fixture(params=["bwrap", "docker"])
def isolating(request: pytest.FixtureRequest, tmp_path: Path) -> SandboxProvider:
    """An isolating provider; docker needs the daemon (the conftest fixture)."""
    if request.param == "docker":
        request.getfixturevalue("docker_daemon")
        return _docker(tmp_path)
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    return _bwrap(tmp_path)


async def test_gridsim_in_a_sandbox_grades_like_in_process(isolating: SandboxProvider) -> None:
    from bundles.gridsim.greedy import greedy_schedule
    from bundles.gridsim.market import Battery

    bundle = load_bundle(GRIDSIM)
    rewards: dict[str, list[float | None]] = {}
    for where, sandbox in (("in-process", None), ("sandboxed", isolating)):
        rewards[where] = []
        with serve(build_app(bundle, sandbox=sandbox)) as url:
            async with EnvClient(url) as env:
                for index in range(3):
                    await env.reset(split="eval", index=index)
                    data = bundle.task("eval", index).data
                    schedule = greedy_schedule(data["prices"], Battery(**data["battery"]))
                    sim = await env.call_tool("simulate_schedule", {"schedule": schedule})
                    assert not sim.observation.is_error and not sim.done
                    out = await env.call_tool("submit_schedule", {"schedule": schedule})
                    assert out.done and out.observation.status == "graded"
                    rewards[where].append(out.reward)
            async with httpx.AsyncClient() as http:
                health = (await http.get(f"{url}/health")).json()
            assert health["envs"] == ("in-process (no sandbox)" if sandbox is None else
                                      f"sandbox {isolating.name}")  # fmt: skip
    assert rewards["sandboxed"] == rewards["in-process"]
    assert all(r is not None and r > 0.2 for r in rewards["sandboxed"])
    assert await isolating.list_owned() == []


async def test_env_code_is_read_only_and_tasks_stay_outside(
    isolating: SandboxProvider, probe: Path
) -> None:
    with serve(build_app(probe, sandbox=isolating)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="train", index=0)
            out = await env.call_tool("where", {})
            info = json.loads(out.observation.text)
            assert info["cwd"] == "/work"
            assert info["uid"] != 0
            assert info["code_writable"] is False
            assert info["tasks_shipped"] is False  # the answers' source never enters
            assert info["shipped"] == ["env.py", "helper.py"]  # the env side: no verifier
            assert info["pid"] != os.getpid()
    assert await isolating.list_owned() == []


async def test_env_failures_are_clear_and_leave_nothing(
    isolating: SandboxProvider, probe: Path
) -> None:
    with serve(build_app(probe, sandbox=isolating, tool_timeout=3.0)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="train", index=0)
            noisy = await env.call_tool("noisy", {})
            assert noisy.observation.text == "quiet answer"
            boom = await env.call_tool("boom", {})
            assert boom.done and boom.reward is None and boom.observation.status == "error"
            assert boom.observation.error is not None
            assert boom.observation.error.error_type == "execution_error"
            assert (
                "RuntimeError: the probe blew up on purpose (helper.py:3)" in boom.observation.text
            )
            assert await isolating.list_owned() == []  # the failed env's sandbox is gone

            await env.reset(split="train", index=0)
            started = time.monotonic()
            hang = await env.call_tool("hang", {})
            assert hang.done and hang.observation.error is not None
            assert hang.observation.error.error_type == "timeout"
            assert time.monotonic() - started < 10
            assert await isolating.list_owned() == []  # the timeout killed the sandbox

            await env.reset(split="train", index=0)
            done = await env.call_tool("echo", {"done": True})
            assert done.done and done.reward == 1.0
            state = await env.state()
            assert state.env == {"calls": ["echo"]}  # the final state outlives the sandbox
    assert await isolating.list_owned() == []


async def _kill_sandbox_of(provider: SandboxProvider) -> None:
    (sid,) = await provider.list_owned()
    if provider.name == "docker":
        from corral.sandboxes.docker import _remove

        await asyncio.to_thread(_remove, provider.client, sid)  # type: ignore[attr-defined]
    else:
        procs = CGROUP_ROOT / "pids" / "corral" / sid / "cgroup.procs"
        if procs.exists():  # every process of the sandbox, the (non-dumpable) runner included
            assert kill_processes_of_cgroup(procs) > 0
        else:  # no cgroups here: the processes working in the folder (not the runner itself)
            folder = provider.records.root / sid  # type: ignore[attr-defined]
            assert kill_processes_in(folder) > 0


async def test_a_killed_sandbox_fails_the_episode_clearly(
    isolating: SandboxProvider, probe: Path
) -> None:
    with serve(build_app(probe, sandbox=isolating)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="train", index=0)
            await env.call_tool("echo", {})
            await _kill_sandbox_of(isolating)
            lost = await env.call_tool("echo", {})
            assert lost.done and lost.observation.error is not None
            assert lost.observation.error.error_type == "execution_error"
            assert "the env stopped answering" in lost.observation.text
            # The socket lives on: the next episode gets a fresh sandbox.
            await env.reset(split="train", index=0)
            assert not (await env.call_tool("echo", {})).observation.is_error
    assert await isolating.list_owned() == []


def test_a_bundle_that_needs_a_sandbox_is_refused_without_one(probe: Path) -> None:
    with pytest.raises(ValueError, match=r"needs a sandbox .*--sandbox bwrap or docker"):
        build_app(probe)


async def test_local_backend_runs_the_env_in_a_subprocess(tmp_path: Path, probe: Path) -> None:
    provider = _local(tmp_path)
    with serve(build_app(probe, sandbox=provider, warm_sandboxes=1)) as url:
        async with httpx.AsyncClient() as http:
            assert "NO isolation" in (await http.get(f"{url}/health")).json()["envs"]
        async with EnvClient(url) as env:
            await env.reset(split="train", index=0)
            info = (await env.call_tool("where", {})).observation.text
            assert f'"pid": {os.getpid()}' not in info
    assert await provider.list_owned() == []


async def _start_server(bundle: Path, backend: str) -> tuple[asyncio.subprocess.Process, str]:
    """``corral serve BUNDLE --sandbox BACKEND`` in a session of its own, once healthy."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "corral.cli", "serve", str(bundle), "--port", str(port),
        "--sandbox", backend, cwd=ROOT, start_new_session=True,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30.0
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                pytest.fail(f"the server exited with {proc.returncode} before serving")
            try:
                if (await http.get(f"{url}/health", timeout=1.0)).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)  # polling interval, not synchronisation
    proc.kill()
    pytest.fail(f"the server at {url} was not healthy within 30 s")


@pytest.mark.parametrize("backend", ["bwrap", "docker"])
async def test_nothing_survives_a_sigkilled_server_once_the_next_one_sweeps(
    request: pytest.FixtureRequest, backend: str, probe: Path
) -> None:
    """A server killed with SIGKILL leaves its episodes' sandboxes; the next server's start-up
    sweep removes them (the owner pid in each record/label is dead)."""
    if backend == "docker":
        request.getfixturevalue("docker_daemon")
    elif shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    watcher = _AllSandboxes(backend)
    before = set(await watcher.ids())
    server, url = await _start_server(probe, backend)
    try:
        async with EnvClient(url) as client:
            await client.reset(split="train", index=0)
            assert '"pid"' in (await client.call_tool("where", {})).observation.text
            server_owned = set(await watcher.ids()) - before
            assert len(server_owned) == 1, "the first server's episode has one sandbox"
            os.killpg(server.pid, signal.SIGKILL)
            await server.wait()
    finally:
        if server.returncode is None:
            os.killpg(server.pid, signal.SIGKILL)
    assert server_owned <= set(await watcher.ids()), "SIGKILL removes nothing: the sweep must"
    second, url = await _start_server(probe, backend)
    try:
        assert not server_owned & set(await watcher.ids())
    finally:
        second.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(second.wait(), 30) == 0


class _AllSandboxes:
    """Every corral sandbox of ``backend`` on this host, any owner's: docker containers with
    corral's owner label; bwrap records and folders in the default state folder."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    async def ids(self) -> list[str]:
        if self.backend == "docker":
            import docker

            client = docker.from_env()
            found = client.containers.list(all=True, filters={"label": "corral.owner"})
            return [c.name for c in found]
        from corral.sandboxes.local import DEFAULT_STATE_DIR

        return sorted({p.name.split(".")[0] for p in (DEFAULT_STATE_DIR / "bwrap").glob("bw-*")})


async def test_shellcraft_is_solved_in_a_sandbox_and_an_idle_episode_scores_zero(
    isolating: SandboxProvider,
) -> None:
    """The shell bundle end to end: the reference solver's commands through the bash tool, in
    the sandbox, graded by the verifier outside it (one task of each family)."""
    from bundles.shellcraft.solver import solve

    bundle = load_bundle(ROOT / "bundles" / "shellcraft")
    tasks = [bundle.task("eval", i) for i in range(8)]
    families = {t.data["family"]: t for t in tasks}
    assert len(families) == 4
    with serve(build_app(bundle, sandbox=isolating)) as url:
        async with EnvClient(url) as env:
            for family, task in sorted(families.items()):
                await env.reset(task_id=task.id)
                for command in solve(task.data):
                    out = await env.call_tool("bash", {"command": command})
                    assert out.observation.text.startswith("exit code: 0"), out
                done = await env.call_tool("submit", {})
                assert done.done and done.reward == pytest.approx(1.0), (family, done)
            await env.reset(task_id=tasks[0].id)
            idle = await env.call_tool("submit", {})
            assert idle.done and idle.reward == 0.0
    assert await isolating.list_owned() == []
