"""Envs that fail or misbehave, and clients that race them, against real env servers on
127.0.0.1: every failure ends the episode clearly, in-process and in a bwrap sandbox alike,
and a step, a state read and a close on one episode always agree.

The probe env meets the test at named pipes (FIFOs) in the task's folder: ``wait`` opens
``started`` for writing (blocking until the test opens it) and then reads ``go`` (blocking until
the test writes it), so a test knows a call is in flight, and ends it, without sleeping.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.envs.client import EnvClient, EnvServerError
from corral.envs.episodes import Episode, json_size
from corral.envs.server import build_app
from corral.sandboxes.base import SandboxProvider
from corral.sandboxes.bwrap import BwrapProvider
from tests.servers import serve

PROBE_TOML = """
name = "failprobe"
version = "1"
system_prompt = "probe"
max_turns = 3

[splits]
train = "tasks/train.jsonl"

[env]
module = "env.py"
class = "FailEnv"

[reward]
score = "calls"

[[tools]]
name = "t"
description = "does what op says"
parameters = { type = "object", properties = { op = { type = "string" } } }
"""

PROBE_ENV = """
import os
from corral.envs.episode import ToolOutcome


class FailEnv:
    def reset(self, task):
        self.dir = task.data["dir"]
        self.calls = 0
        self.none_state = False
        return task.prompt

    def call_tool(self, name, arguments):
        self.calls += 1
        op = arguments.get("op")
        if op == "wait":
            open(os.path.join(self.dir, "started"), "w").close()
            open(os.path.join(self.dir, "go")).read()
            return ToolOutcome("waited")
        if op == "raise":
            raise RuntimeError("the probe failed on purpose")
        if op == "str":
            return "a plain string"
        if op == "int":
            return ToolOutcome(123)
        if op == "nonestate":
            self.none_state = True
            return ToolOutcome("ok")
        if op == "done":
            return ToolOutcome("finished", done=True)
        return ToolOutcome("echo")

    def state(self):
        if os.path.isdir(self.dir):
            with open(os.path.join(self.dir, "state-reads"), "a") as log:
                log.write("read\\n")
        if self.none_state:
            return None
        return {"calls": self.calls}
"""

PROBE_VERIFIER = """
def grade(task, state):
    return {"calls": float(state["calls"])}
"""


@pytest.fixture(scope="module")
def meeting(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where the in-process env and the test meet (the task's ``dir``)."""
    return tmp_path_factory.mktemp("meeting")


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory, meeting: Path) -> Path:
    root = tmp_path_factory.mktemp("bundles") / "failprobe"
    (root / "tasks").mkdir(parents=True)
    (root / "bundle.toml").write_text(PROBE_TOML)
    (root / "env.py").write_text(PROBE_ENV)
    (root / "verifier.py").write_text(PROBE_VERIFIER)
    task = {"id": "t0", "prompt": "go", "data": {"dir": str(meeting)}}
    (root / "tasks" / "train.jsonl").write_text(json.dumps(task) + "\n")
    return root


@pytest.fixture
def pipes(meeting: Path) -> Iterator[Path]:
    """Fresh ``started`` and ``go`` FIFOs and no state-read log in the meeting folder."""
    for name in ("started", "go"):
        os.mkfifo(meeting / name)
    yield meeting
    for name in ("started", "go", "state-reads"):
        (meeting / name).unlink(missing_ok=True)


def _wait_started(folder: Path) -> None:
    with open(folder / "started") as fifo:  # returns once the env has opened it
        fifo.read()


def _release(folder: Path) -> None:
    with open(folder / "go", "w"):  # the env's read ends when this closes
        pass


def _state_reads(folder: Path) -> int:
    path = folder / "state-reads"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(params=["in-process", "bwrap"])
def host(request: pytest.FixtureRequest, tmp_path: Path) -> SandboxProvider | None:
    """Where the env runs: in the server's process, or in a bwrap sandbox."""
    if request.param == "in-process":
        return None
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    return BwrapProvider(f"test-{uuid.uuid4().hex[:8]}", state_dir=tmp_path / "state")


def _step(episode_id: str, op: str) -> dict[str, Any]:
    action = {"type": "call_tool", "tool_name": "t", "arguments": {"op": op}}
    return {"action": action, "episode_id": episode_id}


def test_json_size_counts_utf8_bytes_of_compact_json() -> None:
    assert json_size({"a": "é" * 50}) == len(('{"a":"' + "é" * 50 + '"}').encode()) == 108
    assert json_size({"s": "\ud800"}) == 11  # a lone surrogate: counted, not refused
    assert json_size({1, 2}) is None


async def test_an_integer_too_long_to_parse_is_invalid_args(probe: Path) -> None:
    with serve(build_app(probe)) as url:
        async with EnvClient(url) as env:
            await env.reset(task_id="t0")
            huge = await env.call_tool("t", '{"op": 1' + "0" * 5000 + "}")
            assert not huge.done and huge.observation.error is not None
            assert huge.observation.error.error_type == "invalid_args"
            assert "4300" in huge.observation.text
            echo = await env.call_tool("t", {"op": "echo"})  # the episode is untouched
            assert echo.observation.text == "echo" and echo.observation.status == "running"


@pytest.mark.parametrize("op", ["raise", "str"])
async def test_state_after_an_env_failure_is_the_episodes_not_the_envs(
    probe: Path, host: SandboxProvider | None, op: str
) -> None:
    """On both hosts: the failed call ends the episode, and state then answers 200 with the
    episode's fields and no env state, over HTTP and over the socket."""
    with serve(build_app(probe, sandbox=host)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            reset = await http.post("/reset", json={"task_id": "t0"})
            episode_id = reset.json()["observation"]["episode_id"]
            failed = (await http.post("/step", json=_step(episode_id, op))).json()
            assert failed["done"] and failed["observation"]["status"] == "error"
            assert failed["observation"]["error"]["error_type"] == "execution_error"
            if op == "str":
                assert "the env returned str, not a ToolOutcome" in json.dumps(failed)
            state = await http.get("/state", params={"episode_id": episode_id})
            assert state.status_code == 200, state.text
            body = state.json()
            assert body["done"] and body["status"] == "error" and body["step_count"] == 1
            assert not body["env"]
        async with EnvClient(url) as env:
            await env.reset(task_id="t0")
            await env.call_tool("t", {"op": op})
            after = await env.state()
            assert after.done and after.status == "error" and not after.env
    if host is not None:
        assert await host.list_owned() == []


async def test_misshapen_env_answers_end_the_episode_like_in_a_sandbox(
    probe: Path, host: SandboxProvider | None
) -> None:
    """A ToolOutcome whose content is not text reads as its text; a state that is None ends
    the episode with execution_error (over the socket, which stays open)."""
    with serve(build_app(probe, sandbox=host)) as url:
        async with EnvClient(url) as env:
            await env.reset(task_id="t0")
            number = await env.call_tool("t", {"op": "int"})
            assert number.observation.text == "123" and not number.done
            await env.call_tool("t", {"op": "nonestate"})
            with pytest.raises(EnvServerError) as bad:
                await env.state()
            assert bad.value.code == "EXECUTION_ERROR"
            assert "the env's state is NoneType, not an object" in str(bad.value)
            after = await env.state()
            assert after.done and after.status == "error" and not after.env
            # The socket plays on.
            await env.reset(task_id="t0")
            done = await env.call_tool("t", {"op": "done"})
            assert done.done and done.observation.status == "graded" and done.reward == 1.0
            final = await env.state()
            assert final.env == {"calls": 1}  # the state read at grading


async def test_state_after_a_timeout_never_asks_the_abandoned_env(probe: Path, pipes: Path) -> None:
    """In-process, a timed-out call's thread runs on; state afterwards answers the episode's
    fields without calling env.state() (which would read what that thread is changing)."""
    try:
        with serve(build_app(probe, tool_timeout=0.5)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                reset = await http.post("/reset", json={"task_id": "t0"})
                episode_id = reset.json()["observation"]["episode_id"]
                step = asyncio.ensure_future(http.post("/step", json=_step(episode_id, "wait")))
                await asyncio.to_thread(_wait_started, pipes)
                timed_out = (await step).json()
                assert timed_out["observation"]["error"]["error_type"] == "timeout"
                reads = _state_reads(pipes)
                state = await http.get("/state", params={"episode_id": episode_id})
                assert state.status_code == 200, state.text
                assert state.json()["status"] == "error" and state.json()["done"]
                assert not state.json()["env"]
                assert _state_reads(pipes) == reads  # the env was not asked
    finally:
        await asyncio.to_thread(_release, pipes)  # the abandoned thread may now end


def _spy_close(app: Any) -> threading.Event:
    """An event set when the app's manager starts closing an episode for a client."""
    manager = app.state.episodes
    entered = threading.Event()
    real_close = manager.close

    async def close(episode: Episode, status: str | None = None) -> None:
        entered.set()
        await real_close(episode, status)

    manager.close = close
    return entered


async def _close_rpc(http: httpx.AsyncClient, episode_id: str) -> httpx.Response:
    rpc = {"jsonrpc": "2.0", "id": 1, "method": "openenv/session/close"}
    return await http.post("/mcp", json={**rpc, "params": {"session_id": episode_id}})


async def test_close_waits_for_the_step_in_flight(probe: Path, pipes: Path) -> None:
    """A close while a step runs lets the step finish: the step answers its own result
    (done false, status running), the close then ends the episode and frees its slot."""
    app = build_app(probe, tool_timeout=30)
    entered = _spy_close(app)
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            reset = await http.post("/reset", json={"task_id": "t0"})
            episode_id = reset.json()["observation"]["episode_id"]
            step = asyncio.ensure_future(http.post("/step", json=_step(episode_id, "wait")))
            await asyncio.to_thread(_wait_started, pipes)
            close = asyncio.ensure_future(_close_rpc(http, episode_id))
            assert await asyncio.to_thread(entered.wait, 30)
            assert not close.done()
            await asyncio.to_thread(_release, pipes)
            answer = await step
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["observation"]["result"]["content"][0]["text"] == "waited"
            assert body["done"] is False and body["observation"]["status"] == "running"
            assert (await close).status_code == 200
            gone = await http.get("/state", params={"episode_id": episode_id})
            assert gone.status_code == 404
            assert app.state.episodes.active == 0


async def test_a_close_past_its_bound_makes_the_step_answer_closed(
    probe: Path, pipes: Path
) -> None:
    """When the step outlasts the close's wait, the env is released under it and the step
    answers SESSION_ERROR (410) rather than a result with status and done at odds."""
    app = build_app(probe, tool_timeout=30)
    app.state.episodes.step_limit_s = 0.05
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            reset = await http.post("/reset", json={"task_id": "t0"})
            episode_id = reset.json()["observation"]["episode_id"]
            step = asyncio.ensure_future(http.post("/step", json=_step(episode_id, "wait")))
            await asyncio.to_thread(_wait_started, pipes)
            closed = await _close_rpc(http, episode_id)
            assert closed.status_code == 200
            assert app.state.episodes.active == 0
            await asyncio.to_thread(_release, pipes)
            answer = await step
            assert answer.status_code == 410, answer.text
            assert "closed" in answer.text
