"""Black-box agents on the env server: the ``agent`` frame runs a launch in the episode's own
sandbox (bwrap, docker), in the task's working folder, then the server ends and grades the
episode.

Real servers on 127.0.0.1 (``serve_in_thread``), the shellcraft bundle in bwrap and docker,
and :class:`EnvClient`. The agents are small python3 programs written here (an AgentFile under
``CORRAL_AGENT_DIR``): they reach no gateway, so the launches name a loopback one that is
never connected to. Also: the refusals (a bundle without ``[agent]``, an env in the server's
process, a second agent frame, a gateway the server does not bridge to), the manifest's
``[agent]`` section, and how a sandbox host hands the operator's agent CLIs to its sandboxes.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from corral.envs.agent_bridge import AGENT_BIN_ROOT, AGENT_CLIS_ROOT, AgentPolicy
from corral.envs.bundle import BundleError, load_bundle
from corral.envs.client import EnvClient, EnvServerError, ws_url
from corral.envs.hosting import SandboxHost
from corral.envs.protocol import AGENT_DIR, AgentFile, AgentLaunch
from corral.envs.server import build_app
from corral.sandboxes.base import Bind, SandboxProvider, SandboxSpec
from corral.sandboxes.bwrap import BwrapProvider
from corral.sandboxes.local import LocalProvider
from tests.conftest import ROOT, SANDBOX_IMAGE
from tests.servers import serve

SHELLCRAFT = ROOT / "bundles" / "shellcraft"
GRIDSIM = ROOT / "bundles" / "gridsim"
# Never connected to: the agents here talk to no model.
GATEWAY = "http://127.0.0.1:9"
CLIS_DIR = Path(os.environ.get("CORRAL_AGENT_CLIS", "/var/cache/corral-agent-clis"))


def agent_launch(script: str, *, timeout_s: float = 60.0, **fields: Any) -> AgentLaunch:
    """A launch running ``script`` (python3 source) from CORRAL_AGENT_DIR in the workspace."""
    program = AgentFile(
        area="agent_dir",
        path="agent.py",
        content_b64=base64.b64encode(script.encode()).decode(),
    )
    return AgentLaunch(
        harness="command",
        argv=["python3", f"{AGENT_DIR}/agent.py"],
        files=[program],
        gateway=fields.pop("gateway", GATEWAY),
        timeout_s=timeout_s,
        **fields,
    )


def solving_script(commands: list[str]) -> str:
    """An agent that runs ``commands`` (shellcraft's reference solution of one task, written
    from its prompt's parameters) with bash in its working folder, reading the input files
    there, then exits 0."""
    return (
        "import json, subprocess, sys\n"
        f"for command in json.loads({json.dumps(json.dumps(commands))}):\n"
        "    subprocess.run(['bash', '-c', command], check=True)\n"
        "print('solved')\n"
    )


@pytest.fixture(params=["bwrap", "docker", "local"])
def sandbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SandboxProvider]:
    """A sandbox provider: bwrap, docker (it needs the daemon: the conftest fixture), and
    local (no isolation: the links to the CLIs are host paths, put on PATH as they are)."""
    owner = f"test-{uuid.uuid4().hex[:8]}"
    if request.param == "docker":
        request.getfixturevalue("docker_daemon")
        from corral.sandboxes.docker import DockerProvider

        yield DockerProvider(owner, image=SANDBOX_IMAGE)
        return
    if request.param == "local":
        yield LocalProvider(owner, state_dir=tmp_path / "state")
        return
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    yield BwrapProvider(owner, state_dir=tmp_path / "state")


# -- the manifest and the reset observation -----------------------------------------------


MINI_TOML = """
name = "mini"
version = "1"
system_prompt = "call finish"
max_turns = 2

[splits]
train = "tasks/train.jsonl"

[env]
module = "env.py"
class = "MiniEnv"

[reward]
score = "finished"

[agent]
instructions = "just exit"
finish_tool = "{finish}"

[[tools]]
name = "finish"
description = "end the episode"
parameters = {{ type = "object", properties = {{}} }}
"""

MINI_ENV = """
from corral.envs.episode import ToolOutcome


class MiniEnv:
    def __init__(self):
        self.finished = False

    def reset(self, task):
        return task.prompt

    def call_tool(self, name, arguments):
        self.finished = True
        return ToolOutcome("finished", done=True)

    def state(self):
        return {"finished": self.finished}
"""


def mini_bundle(root: Path, finish: str = "finish") -> Path:
    """A bundle with an ``[agent]`` section that needs no sandbox."""
    (root / "tasks").mkdir(parents=True)
    (root / "bundle.toml").write_text(MINI_TOML.format(finish=finish))
    (root / "env.py").write_text(MINI_ENV)
    (root / "verifier.py").write_text(
        "def grade(task, state):\n    return {'finished': float(state['finished'])}\n"
    )
    (root / "tasks" / "train.jsonl").write_text('{"id": "t0", "prompt": "go"}\n')
    return root


def test_the_agent_section_is_typed_and_its_finish_tool_must_be_a_tool(tmp_path: Path) -> None:
    shellcraft = load_bundle(SHELLCRAFT).manifest.agent
    assert shellcraft is not None and shellcraft.finish_tool == "submit"
    assert "working folder" in shellcraft.instructions and "exit" in shellcraft.instructions
    assert "bash" not in shellcraft.instructions and "submit" not in shellcraft.instructions
    assert load_bundle(GRIDSIM).manifest.agent is None
    with pytest.raises(BundleError, match=r"agent\.finish_tool: 'nope' is not one of"):
        load_bundle(mini_bundle(tmp_path / "bad", finish="nope"))


async def test_the_reset_observation_carries_the_instructions_only_when_set(
    tmp_path: Path,
) -> None:
    for bundle, expected in ((mini_bundle(tmp_path / "mini"), "just exit"), (GRIDSIM, None)):
        with serve(build_app(bundle)) as url:
            async with websockets.connect(ws_url(url)) as ws:
                await ws.send(json.dumps({"type": "reset"}))
                observation = json.loads(await ws.recv())["data"]["observation"]
        assert observation.get("agent_instructions") == expected
        assert ("agent_instructions" in observation) == (expected is not None)


# -- refusals that leave the episode as it was ----------------------------------------------


async def test_a_bundle_without_an_agent_section_is_refused() -> None:
    with serve(build_app(GRIDSIM)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=0)
            with pytest.raises(EnvServerError) as refused:
                await env.run_agent(agent_launch("print('hi')"))
            assert refused.value.code == "EXECUTION_ERROR"
            assert refused.value.reason == "no_agent_support"
            assert "[agent]" in str(refused.value)
            assert (await env.state()).status == "running"


async def test_an_env_in_the_servers_process_runs_no_agent(tmp_path: Path) -> None:
    with serve(build_app(mini_bundle(tmp_path / "mini"))) as url:
        async with EnvClient(url) as env:
            with pytest.raises(EnvServerError) as no_episode:
                await env.run_agent(agent_launch("print('hi')"))
            assert no_episode.value.reason == "no_episode"
            await env.reset()
            with pytest.raises(EnvServerError) as refused:
                await env.run_agent(agent_launch("print('hi')"))
            assert refused.value.reason == "no_agent_support"
            assert "needs a sandbox" in str(refused.value)
            # Untouched: the episode plays on and grades.
            out = await env.call_tool("finish", {})
            assert out.done and out.reward == 1.0


# -- the agent CLIs handed to sandboxes ---------------------------------------------------


CLAUDE_IN_INSTALL = "node_modules/@anthropic-ai/claude-code/bin/claude.exe"


def same_file(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def fake_npm_install(root: Path) -> Path:
    """An npm install's layout holding the two CLIs (copies of a native executable)."""
    native = Path(shutil.which("true") or "/bin/true").resolve()
    claude = root / CLAUDE_IN_INSTALL
    codex = root / "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
    for path in (claude, codex):
        path.parent.mkdir(parents=True)
        shutil.copy2(native, path)
    wrapper = root / "node_modules/.bin/codex"  # a node wrapper: never the one linked
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text("#!/usr/bin/env node\n")
    return root


async def test_a_sandbox_host_binds_the_clis_and_a_folder_of_links(tmp_path: Path) -> None:
    clis = fake_npm_install(tmp_path / "clis")
    bundle = load_bundle(SHELLCRAFT)
    policy = AgentPolicy(gateways=("http://10.0.0.5:8000",), max_timeout_s=99.0)
    bound = SandboxHost(
        bundle,
        BwrapProvider("test-clis", state_dir=tmp_path / "state"),
        SandboxSpec(),
        agent_clis=clis,
        agent_policy=policy,
    )
    local = SandboxHost(
        bundle, LocalProvider("test-clis", state_dir=tmp_path / "state"), SandboxSpec(),
        agent_clis=clis,
    )  # fmt: skip
    try:
        links = {b.target: b.source for b in bound.spec.binds}
        assert links[AGENT_CLIS_ROOT] == clis.resolve()
        bin_dir = links[AGENT_BIN_ROOT]
        assert Bind(source=bin_dir, target=AGENT_BIN_ROOT) in bound.spec.binds
        assert sorted(p.name for p in bin_dir.iterdir()) == ["claude", "codex"]
        assert os.readlink(bin_dir / "claude") == f"{AGENT_CLIS_ROOT}/{CLAUDE_IN_INSTALL}"
        assert os.readlink(bin_dir / "codex").startswith(f"{AGENT_CLIS_ROOT}/node_modules/@openai/")
        assert bin_dir.stat().st_mode & 0o777 == 0o755
        assert bound.agents.policy == AgentPolicy(
            gateways=policy.gateways, max_timeout_s=99.0, path_dirs=(AGENT_BIN_ROOT,)
        )
        assert bound.agents.workdir == "/work"
        # No isolation: the links point at the host's files and their folder goes on PATH.
        (local_bin,) = local.agents.policy.path_dirs
        assert same_file(Path(local_bin, "claude"), clis / CLAUDE_IN_INSTALL)
        assert local.spec.binds == ()
    finally:
        await bound.aclose()
        await local.aclose()
    with pytest.raises(ValueError, match="is not a folder"):
        SandboxHost(bundle, LocalProvider("t", state_dir=tmp_path / "s"), SandboxSpec(),
                    agent_clis=tmp_path / "missing")  # fmt: skip


# -- agents in a sandbox -----------------------------------------------------------------


async def test_an_agent_solves_a_shellcraft_task_and_the_episode_is_graded(
    sandbox: SandboxProvider,
) -> None:
    from bundles.shellcraft.solver import solve

    bundle = load_bundle(SHELLCRAFT)
    task = bundle.task("eval", 0)
    with serve(build_app(bundle, sandbox=sandbox)) as url:
        async with EnvClient(url) as env:
            reset = await env.reset(task_id=task.id)
            assert reset.observation.agent_instructions is not None
            result = await env.run_agent(agent_launch(solving_script(solve(task.data))))
            assert result.run.exit_code == 0 and not result.run.timed_out, result.run
            assert "solved" in result.run.transcript
            assert result.status == "graded" and result.reward == pytest.approx(1.0)
            assert result.scores is not None and result.scores["correct"] == 1.0
            assert result.scores["submitted"] == 1.0  # the finish tool ended it
            state = await env.state()
            assert state.done and state.status == "graded" and state.env is not None
            assert all(o["text"] for o in state.env["outputs"].values()), state.env["outputs"]
    assert await sandbox.list_owned() == []


async def test_an_agent_that_fails_still_has_its_episode_graded(sandbox: SandboxProvider) -> None:
    """A wrong answer file, then exit 3: the exit code is reported, the folder graded."""
    bundle = load_bundle(SHELLCRAFT)
    task = bundle.task("eval", 0)
    (answer,) = task_answers(bundle, task)
    script = (
        "import os, sys\n"
        f"open({answer!r}, 'w').write('not,the answer\\n')\n"
        "print('files here:', sorted(os.listdir('.')))\n"
        "sys.exit(3)\n"
    )
    with serve(build_app(bundle, sandbox=sandbox)) as url:
        async with EnvClient(url) as env:
            await env.reset(task_id=task.id)
            result = await env.run_agent(agent_launch(script))
            assert result.run.exit_code == 3 and "files here:" in result.run.transcript
            assert result.status == "graded" and result.reward == 0.0
            state = await env.state()
            assert state.env is not None
            assert state.env["outputs"][answer]["text"] == "not,the answer\n"
    assert await sandbox.list_owned() == []


def task_answers(bundle: Any, task: Any) -> list[str]:
    """The answer files' names of ``task``, as the env's view gives them."""
    return sorted(bundle.env_task(task).data["output_files"])


async def test_a_second_agent_frame_is_refused_while_one_runs(sandbox: SandboxProvider) -> None:
    """Frames on the socket while an agent runs: a second agent and a step are refused, state
    is answered; the agent past its budget is killed and the episode still graded."""
    bundle = load_bundle(SHELLCRAFT)
    task = bundle.task("eval", 1)
    sleeper = agent_launch("import time\ntime.sleep(600)\n", timeout_s=3.0, kill_grace_s=1.0)
    frame = {"type": "agent", "data": sleeper.model_dump(mode="json")}
    with serve(build_app(bundle, sandbox=sandbox)) as url:
        async with websockets.connect(ws_url(url)) as ws:

            async def ask(message: dict[str, Any]) -> dict[str, Any]:
                await ws.send(json.dumps(message))
                reply: dict[str, Any] = json.loads(await ws.recv())
                assert reply.get("request_id") == message.get("request_id"), reply
                return reply

            await ask({"type": "reset", "data": {"task_id": task.id}, "request_id": "r"})
            await ws.send(json.dumps({**frame, "request_id": "a1"}))
            second = await ask({**frame, "request_id": "a2"})
            assert second["type"] == "error" and second["data"]["reason"] == "agent_running"
            step = {"type": "call_tool", "tool_name": "bash", "arguments": {"command": "ls"}}
            refused = await ask({"type": "step", "data": step, "request_id": "s"})
            assert refused["data"]["reason"] == "agent_running"
            state = await ask({"type": "state", "request_id": "st"})
            assert state["type"] == "state" and state["data"]["status"] == "running"
            done = json.loads(await ws.recv())
            assert done["type"] == "agent" and done["request_id"] == "a1", done
            run = done["data"]["run"]
            assert run["timed_out"] and run["exit_code"] is None
            assert done["data"]["status"] == "graded" and done["data"]["reward"] == 0.0
    assert await sandbox.list_owned() == []


async def test_a_launch_the_server_does_not_allow_leaves_the_episode_playable(
    sandbox: SandboxProvider,
) -> None:
    bundle = load_bundle(SHELLCRAFT)
    task = bundle.task("eval", 2)
    with serve(build_app(bundle, sandbox=sandbox)) as url:
        async with EnvClient(url) as env:
            await env.reset(task_id=task.id)
            with pytest.raises(EnvServerError) as refused:
                await env.run_agent(agent_launch("print(1)", gateway="http://10.9.8.7:8000"))
            assert refused.value.code == "VALIDATION_ERROR"
            assert refused.value.reason == "agent_refused"
            out = await env.call_tool("bash", {"command": "ls"})
            assert out.observation.text.startswith("exit code: 0")
            assert (await env.state()).status == "running"
        # The client's close closed the episode: its sandbox is gone.
    assert await sandbox.list_owned() == []


async def test_the_real_clis_are_on_the_agents_path(sandbox: SandboxProvider) -> None:
    """With --agent-clis the sandbox has ``codex`` and ``claude`` first on PATH: an agent
    runs ``codex --version`` from the operator's install, bound read-only."""
    if not (CLIS_DIR / "node_modules").is_dir():
        pytest.skip(f"the agent CLIs are not installed in {CLIS_DIR}")
    script = (
        "import shutil, subprocess\n"
        "print(shutil.which('codex'), shutil.which('claude'))\n"
        "print(subprocess.run(['codex', '--version'], capture_output=True, text=True).stdout)\n"
    )
    bundle = load_bundle(SHELLCRAFT)
    with serve(build_app(bundle, sandbox=sandbox, agent_clis=CLIS_DIR)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=3)
            result = await env.run_agent(agent_launch(script))
    assert result.run.exit_code == 0, result.run
    if sandbox.host_binds:  # bound at fixed paths; under local, the host's links folder
        assert f"{AGENT_BIN_ROOT}/codex {AGENT_BIN_ROOT}/claude" in result.run.transcript
    assert "codex-cli" in result.run.transcript
    assert await sandbox.list_owned() == []


async def test_closing_the_socket_stops_the_agent_and_removes_its_sandbox(
    sandbox: SandboxProvider,
) -> None:
    bundle = load_bundle(SHELLCRAFT)
    sleeper = agent_launch("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    frame = {"type": "agent", "data": sleeper.model_dump(mode="json"), "request_id": "a"}
    with serve(build_app(bundle, sandbox=sandbox)) as url:
        async with websockets.connect(ws_url(url)) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {"split": "eval", "index": 4}}))
            assert json.loads(await ws.recv())["type"] == "observation"
            await ws.send(json.dumps(frame))
            # state answers while it runs: the agent's sandbox is there until the close.
            await ws.send(json.dumps({"type": "state", "request_id": "s"}))
            assert json.loads(await ws.recv())["data"]["status"] == "running"
            assert len(await sandbox.list_owned()) == 1
            await ws.send(json.dumps({"type": "close"}))
            await ws.wait_closed()
        assert await sandbox.list_owned() == []


def test_serve_takes_the_agent_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from corral.cli import build_parser
    from corral.cli.servers import _agent_clis
    from corral.envs.server import DEFAULT_AGENT_MAX_TIMEOUT_S

    parser = build_parser()
    args = parser.parse_args(["serve", "b"])
    assert args.agent_gateway == [] and args.agent_clis is None
    assert args.agent_max_timeout == DEFAULT_AGENT_MAX_TIMEOUT_S == AgentPolicy().max_timeout_s
    args = parser.parse_args(
        ["serve", "b", "--agent-gateway", "http://a:1", "--agent-gateway", "https://b:2",
         "--agent-max-timeout", "90", "--agent-clis", "/x"]
    )  # fmt: skip
    assert args.agent_gateway == ["http://a:1", "https://b:2"] and args.agent_max_timeout == 90
    monkeypatch.delenv("CORRAL_AGENT_CLIS", raising=False)
    assert _agent_clis(None) is None and _agent_clis("/x") == Path("/x")
    monkeypatch.setenv("CORRAL_AGENT_CLIS", "/from/env")
    assert _agent_clis(None) == Path("/from/env") and _agent_clis("/x") == Path("/x")
