"""Black-box agents against real local servers: the tiny model behind the local engine and the
gateway, gridsim behind the env server, the episode's MCP server, and agents that are separate
processes built on the ``openai`` and ``mcp`` SDKs only (the example agent, and a scripted one
that follows a plan given on its command line).

The tiny model was imprinted only to call a ``get_weather`` tool: in gridsim it plays nonsense,
so these tests check the plumbing (turns recorded, calls forwarded, rewards and failures landing
on the session), not the play.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from corral.adapters.agents import (
    AgentConfigError,
    AgentRollout,
    play_rows_with_agent,
    play_with_agent,
    summarize,
)
from corral.adapters.mcp_tools import META_KEY, EpisodeTools, serve_episode_tools
from corral.cli.play import add_play_command, cmd_play
from corral.engines.tiny_model import TOOLS
from corral.envs.client import EnvClient
from corral.envs.server import build_app
from corral.gateway.client import GatewayAdmin, GatewayAdminError
from corral.rollouts.rows import Row, RowSettings, read_rows, write_rows
from corral.stack import StackURLs, local_stack
from tests.servers import free_port, serve

ROOT = Path(__file__).resolve().parent.parent
GRIDSIM = ROOT / "bundles" / "gridsim"
EXAMPLE_AGENT = ROOT / "examples" / "agent.py"
ADMIN_TOKEN = "admin-secret"
ADMIN_VAR = "CORRAL_TEST_ADMIN_TOKEN"
ENV_TOKEN = "env-secret"
ENV_VAR = "CORRAL_TEST_ENV_TOKEN"
IDLE = [0] * 24
# The tiny model on CPU: short answers keep each model call well under a second.
SAMPLING = {"max_tokens": 48, "temperature": 0.0}
ENVIRON = {**os.environ, ENV_VAR: ENV_TOKEN, "AGENT_MAX_STEPS": "3"}
AGENT_TIMEOUT_S = 120.0  # generous: an agent that hangs fails its test, it does not pass it


# ---------------------------------------------------------------------------------------------
# the scripted agent: a separate process on the openai and mcp SDKs only, following a plan

SCRIPTED_AGENT = r"""
import asyncio, json, os, signal, subprocess, sys, time
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from openai import AsyncOpenAI

async def main(plan, log_path):
    log = open(log_path, "a")
    llm = AsyncOpenAI(max_retries=0)
    headers = {"Authorization": "Bearer " + os.environ["CORRAL_MCP_TOKEN"]}
    async with httpx2.AsyncClient(headers=headers) as http, Client(
        streamable_http_client(os.environ["CORRAL_MCP_URL"], http_client=http)
    ) as mcp:
        for step in plan:
            do = step["do"]
            if do == "model":
                await llm.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": os.environ["CORRAL_TASK_PROMPT"]}],
                )
            elif do == "tool":
                result = await mcp.call_tool(step["name"], step["arguments"])
                text = "".join(b.text for b in result.content if b.type == "text")
                meta = (result.meta or {}).get("corral/episode")
                entry = {"is_error": result.is_error, "text": text, "meta": meta}
                log.write(json.dumps(entry) + "\n")
                log.flush()
            elif do == "env":
                log.write(json.dumps({"env": {k: os.environ.get(k) for k in step["vars"]}}) + "\n")
                log.flush()
            elif do == "pids":
                child = subprocess.Popen(["sleep", "3600"])
                with open(step["path"], "w") as f:
                    json.dump({"pid": os.getpid(), "pgid": os.getpgid(0), "child": child.pid}, f)
            elif do == "ignore_sigterm":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            elif do == "signal":
                with open(step["fifo"], "w") as f:
                    f.write(step.get("message", "ready"))
            elif do == "wait":
                with open(step["fifo"]) as f:
                    f.read()
            elif do == "hang":
                while True:
                    time.sleep(3600)
            elif do == "exit":
                print(step.get("stderr", ""), file=sys.stderr, flush=True)
                os._exit(step["code"])

asyncio.run(main(json.loads(sys.argv[1]), sys.argv[2]))
"""


Scripted = Callable[[list[dict[str, Any]]], tuple[list[str], Path]]


@pytest.fixture
def scripted(tmp_path: Path) -> Scripted:
    """``scripted(plan)`` -> (the agent's argv, the path of its log of tool results)."""
    script = tmp_path / "scripted_agent.py"
    script.write_text(SCRIPTED_AGENT)
    log = tmp_path / "agent-log.jsonl"

    def make(plan: list[dict[str, Any]]) -> tuple[list[str], Path]:
        return [sys.executable, str(script), json.dumps(plan), str(log)], log

    return make


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------------------------
# servers


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[StackURLs]:
    with local_stack(tiny_model_dir, admin_token=ADMIN_TOKEN) as urls:
        yield urls


class EnvServer:
    """gridsim served in this process (behind ``ENV_TOKEN``) and its rows."""

    def __init__(self, url: str, app: Any, rows: list[Row]) -> None:
        self.url, self.app, self.rows = url, app, rows

    def steps(self, outcome: str) -> float:
        """The server's count of tool calls with ``outcome`` (``ok``, ``tool_error``, ...)."""
        registry = self.app.state.episodes.metrics.registry
        return registry.get_sample_value("corral_env_steps_total", {"outcome": outcome}) or 0.0


@pytest.fixture(scope="module")
def env_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvServer]:
    app = build_app(GRIDSIM, token=ENV_TOKEN)
    with serve(app) as url:
        out = tmp_path_factory.mktemp("rows")
        settings = RowSettings(tool_timeout=30.0, reset_timeout=30.0, token_var=ENV_VAR)
        write_rows(url, out, settings, token=ENV_TOKEN)
        yield EnvServer(url, app, read_rows(out / "eval.jsonl"))


@pytest.fixture
async def gateway(stack: StackURLs) -> AsyncIterator[GatewayAdmin]:
    async with GatewayAdmin(stack.gateway, ADMIN_TOKEN) as admin:
        yield admin


def weather_row(row: Row) -> Row:
    """``row`` with a weather question and only the tiny model's weather tool: the prompt the
    tiny model was imprinted to answer with a tool call (another tool in its list, such as
    gridsim's ``end_turn``, is out of its imprint and can garble the call). The episode is
    still gridsim's, so the env answers that call as an unknown tool."""
    changed = row.model_copy(deep=True)
    changed.messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    changed.metadata.tools = [TOOLS[0]]
    return changed


async def play_row(
    row: Row, gateway: GatewayAdmin, agent_cmd: str | list[str], **options: Any
) -> AgentRollout:
    """``play_with_agent`` as these tests play: the agent inherits ``ENVIRON``, its model
    answers are kept short (``SAMPLING``) and it has ``AGENT_TIMEOUT_S``, unless ``options``
    say otherwise."""
    settings: dict[str, Any] = {"timeout_s": AGENT_TIMEOUT_S, "env": ENVIRON, "sampling": SAMPLING}
    return await play_with_agent(row, gateway=gateway, agent_cmd=agent_cmd, **settings | options)


def assert_flagged(rollout: AgentRollout, pattern: str) -> None:
    """The rollout failed for ``pattern``, and every sample of its session carries it."""
    assert rollout.failed, rollout.summary()
    assert rollout.reason is not None and re.search(pattern, rollout.reason), rollout.reason
    for sample in rollout.samples:
        assert sample.status == "failed"
        assert sample.metadata["failure"] == rollout.reason


# ---------------------------------------------------------------------------------------------
# the MCP endpoint


@contextlib.asynccontextmanager
async def episode_tools(env: EnvServer, row: Row) -> AsyncIterator[tuple[EpisodeTools, Any]]:
    async with EnvClient(env.url, ENV_TOKEN) as client:
        await client.reset(split=row.metadata.split, index=row.metadata.index)
        tools = EpisodeTools(client, row.metadata.tools)
        async with serve_episode_tools(tools) as endpoint:
            yield tools, endpoint


@contextlib.asynccontextmanager
async def mcp_client(url: str, token: str, mode: str = "auto") -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode) as client,
    ):
        yield client


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"},
    },
}


async def test_mcp_endpoint_refuses_a_missing_or_wrong_token(env_server: EnvServer) -> None:
    async with episode_tools(env_server, env_server.rows[0]) as (tools, endpoint):
        accept = {"Accept": "application/json, text/event-stream"}
        async with httpx.AsyncClient() as http:
            for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": endpoint.token}):
                answer = await http.post(endpoint.url, json=INITIALIZE, headers={**accept, **auth})
                assert answer.status_code == 401, auth
                assert answer.headers["www-authenticate"] == "Bearer"
            good = {**accept, "Authorization": f"Bearer {endpoint.token}"}
            answer = await http.post(endpoint.url, json=INITIALIZE, headers=good)
            assert answer.status_code == 200
        assert tools.calls == 0


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_mcp_lists_the_rows_tools_exactly(env_server: EnvServer, mode: str) -> None:
    """``legacy``: the initialize handshake older MCP clients speak; ``auto``: the SDK's
    current negotiation."""
    row = env_server.rows[0]
    async with (
        episode_tools(env_server, row) as (_, endpoint),
        mcp_client(endpoint.url, endpoint.token, mode) as client,
    ):
        listed = {t.name: t for t in (await client.list_tools()).tools}
    expected = {t["function"]["name"]: t["function"] for t in row.metadata.tools}
    assert list(listed) == list(expected) == ["simulate_schedule", "submit_schedule", "end_turn"]
    for name, function in expected.items():
        assert listed[name].input_schema == function["parameters"]
    assert listed["simulate_schedule"].description == expected["simulate_schedule"]["description"]
    assert "ends the episode" in (listed["end_turn"].description or "")


async def test_tool_errors_are_mcp_error_results_and_the_episode_goes_on(
    env_server: EnvServer,
) -> None:
    row = env_server.rows[1]
    errors_before = env_server.steps("tool_error")
    async with (
        episode_tools(env_server, row) as (tools, endpoint),
        mcp_client(endpoint.url, endpoint.token) as client,
    ):
        unknown = await client.call_tool("get_weather", {"city": "Paris"})
        bad = await client.call_tool("simulate_schedule", {"schedule": "idle"})
        simulated = await client.call_tool("simulate_schedule", {"schedule": IDLE})
        submitted = await client.call_tool("submit_schedule", {"schedule": IDLE})
        after = await client.call_tool("simulate_schedule", {"schedule": IDLE})
    assert unknown.is_error and "unknown tool 'get_weather'" in unknown.content[0].text  # type: ignore[union-attr]
    assert bad.is_error and (bad.meta or {})[META_KEY] == {"done": False, "status": "running"}
    assert not simulated.is_error
    assert json.loads(simulated.content[0].text)["valid"] is True  # type: ignore[union-attr]
    assert not submitted.is_error
    assert (submitted.meta or {})[META_KEY] == {"done": True, "status": "graded"}
    assert after.is_error and "the episode is over" in after.content[0].text  # type: ignore[union-attr]
    # Four calls reached the env (the one after the end did not), two of them tool errors.
    assert tools.calls == 4
    assert env_server.steps("tool_error") - errors_before == 2
    assert tools.outcome is not None and tools.outcome.reward == pytest.approx(0.2)
    assert tools.failure is None


# ---------------------------------------------------------------------------------------------
# rollouts with the example agent


async def test_example_agent_plays_rows_through_the_gateway(
    env_server: EnvServer, gateway: GatewayAdmin
) -> None:
    """Two gridsim rows at once: each session records the agent's turns, the episode is ended
    and graded after the agent exits, and the reward lands on every sample."""
    graded_before = _episodes(env_server, "graded")
    seen: list[str] = []
    rollouts = await play_rows_with_agent(
        env_server.rows[:2],
        gateway=gateway,
        agent_cmd=[sys.executable, str(EXAMPLE_AGENT)],
        concurrency=2,
        on_done=lambda r: seen.append(r.task_id),
        timeout_s=AGENT_TIMEOUT_S,
        env=ENVIRON,
        sampling=SAMPLING,
    )
    assert [r.task_id for r in rollouts] == [r.metadata.task_id for r in env_server.rows[:2]]
    assert sorted(seen) == sorted(r.task_id for r in rollouts)
    for rollout in rollouts:
        assert not rollout.failed, rollout.summary()
        assert rollout.agent_exit_code == 0
        assert rollout.turns >= 1 and rollout.samples
        assert rollout.status == "graded" and rollout.reward is not None
        assert rollout.scores is not None and rollout.scores["grade"] == rollout.reward
        for sample in rollout.samples:
            assert sample.reward == rollout.reward and sample.status != "failed"
            assert sample.rollout_id == rollout.session_id
            assert sample.metadata["task_id"] == rollout.task_id
            assert sum(sample.loss_mask) > 0  # the model's tokens are trainable
    assert _episodes(env_server, "graded") - graded_before == 2


async def test_example_agent_tool_calls_reach_the_env_through_mcp(
    env_server: EnvServer, gateway: GatewayAdmin
) -> None:
    """The one prompt the tiny model answers with tool calls: every call goes model -> agent ->
    MCP -> env, and the env's answer (an unknown tool) goes back into the conversation."""
    errors_before = env_server.steps("tool_error")
    rollout = await play_row(
        weather_row(env_server.rows[2]), gateway, [sys.executable, str(EXAMPLE_AGENT)]
    )
    assert not rollout.failed, rollout.summary()
    assert rollout.tool_calls >= 1
    assert env_server.steps("tool_error") - errors_before == rollout.tool_calls
    # The model was called again after the tool result: the turns merged into one sample.
    assert rollout.turns >= 2
    assert [s.reward for s in rollout.samples] == [0.0] * len(rollout.samples)
    assert 0 in rollout.samples[0].loss_mask  # the tool result's tokens are observations


# ---------------------------------------------------------------------------------------------
# rollouts with scripted agents


async def test_scripted_submission_sets_the_reward_on_the_session(
    env_server: EnvServer, gateway: GatewayAdmin, scripted: Scripted
) -> None:
    argv, log = scripted(
        [
            {"do": "env", "vars": [ENV_VAR, "OPENAI_BASE_URL", "CORRAL_SYSTEM_PROMPT"]},
            {"do": "model"},
            {"do": "tool", "name": "submit_schedule", "arguments": {"schedule": IDLE}},
        ]
    )
    row = env_server.rows[3]
    rollout = await play_row(row, gateway, argv)
    assert not rollout.failed, rollout.summary()
    assert rollout.reward == pytest.approx(0.2) and rollout.status == "graded"
    assert rollout.tool_calls == 1 and rollout.turns == 1
    assert rollout.samples and all(s.reward == pytest.approx(0.2) for s in rollout.samples)
    env_seen, submitted = read_log(log)
    # The agent reaches the env only through MCP: the env server's token is kept from it.
    assert env_seen["env"][ENV_VAR] is None
    assert env_seen["env"]["OPENAI_BASE_URL"].endswith(f"/sessions/{rollout.session_id}/v1")
    assert env_seen["env"]["CORRAL_SYSTEM_PROMPT"] == row.messages[0]["content"]
    assert submitted["meta"] == {"done": True, "status": "graded"}


async def test_agent_that_calls_no_tool_is_graded_not_failed(
    env_server: EnvServer, gateway: GatewayAdmin, scripted: Scripted
) -> None:
    """Stopping without a tool call is bad play, not a failure: corral ends the episode with
    end_turn and gridsim grades a missing submission 0."""
    argv, _ = scripted([{"do": "model"}])
    rollout = await play_row(env_server.rows[4], gateway, argv)
    assert not rollout.failed, rollout.summary()
    assert rollout.tool_calls == 0
    assert rollout.reward == 0.0 and rollout.status == "graded"
    assert rollout.scores is not None and rollout.scores["valid"] == 0.0
    assert [s.reward for s in rollout.samples] == [0.0]


async def test_agent_that_never_calls_its_model_is_failed(
    env_server: EnvServer, gateway: GatewayAdmin, scripted: Scripted
) -> None:
    argv, _ = scripted([{"do": "tool", "name": "submit_schedule", "arguments": {"schedule": IDLE}}])
    rollout = await play_row(env_server.rows[5], gateway, argv)
    assert_flagged(rollout, "no model turn")
    assert rollout.samples == []
    assert rollout.reward == pytest.approx(0.2)  # reported, but not set: nothing to train on


async def test_agent_exiting_nonzero_is_failed_with_its_stderr(
    env_server: EnvServer, gateway: GatewayAdmin, scripted: Scripted
) -> None:
    argv, _ = scripted([{"do": "model"}, {"do": "exit", "code": 3, "stderr": "boom-7f3a"}])
    rollout = await play_row(env_server.rows[6], gateway, argv)
    assert_flagged(rollout, r"exited with code 3(.|\n)*boom-7f3a")
    assert rollout.agent_exit_code == 3 and len(rollout.samples) == 1
    assert rollout.status == "running"  # never ended: a failed rollout is not graded


def _live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that are still running. A killed process that is not
    ours (the agent's child, reparented to init) stays a zombie until init reaps it: dead,
    but still counted in its group, so zombies are left out."""
    live = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(entry.name))
    return live


def assert_group_dead(started: dict[str, int]) -> None:
    """The agent (reaped: no such process) and everything in its process group are dead."""
    assert started["pgid"] == started["pid"]  # it ran in a group of its own
    with pytest.raises(ProcessLookupError):
        os.kill(started["pid"], 0)
    assert _live_members(started["pgid"]) == []


async def test_agent_past_its_timeout_is_killed_with_its_process_group(
    env_server: EnvServer, gateway: GatewayAdmin, scripted: Scripted, tmp_path: Path
) -> None:
    """An agent that ignores SIGTERM and left a child behind: the whole group is SIGKILLed
    after the grace period and the rollout is failed."""
    pids = tmp_path / "pids.json"
    argv, _ = scripted(
        [
            {"do": "model"},
            {"do": "ignore_sigterm"},
            {"do": "pids", "path": str(pids)},
            {"do": "hang"},
        ]
    )
    rollout = await play_row(env_server.rows[7], gateway, argv, timeout_s=8.0, kill_grace_s=0.5)
    assert_flagged(rollout, "did not exit within 8 s and was killed")
    assert rollout.agent_exit_code is None and len(rollout.samples) == 1
    assert_group_dead(json.loads(pids.read_text()))  # written before the agent hung


async def test_episode_ending_without_a_reward_is_failed(
    gateway: GatewayAdmin, scripted: Scripted, tmp_path: Path
) -> None:
    """A reward function that raises: the env ends the episode with no reward, which is a
    failure, not a 0."""

    def broken_reward(scores: dict[str, float]) -> float:
        raise RuntimeError("reward-crash-51c2")

    with serve(build_app(GRIDSIM, reward=broken_reward)) as url:
        row = await _row_for(url, tmp_path)
        argv, log = scripted(
            [
                {"do": "model"},
                {"do": "tool", "name": "submit_schedule", "arguments": {"schedule": IDLE}},
            ]
        )
        rollout = await play_row(row, gateway, argv)
    assert_flagged(rollout, "ended without a reward: .*reward-crash-51c2")
    assert rollout.reward is None and rollout.status == "error" and len(rollout.samples) == 1
    assert read_log(log)[0]["meta"] == {"done": True, "status": "error"}


async def test_env_server_unreachable_fails_the_rollout_before_the_agent_starts(
    env_server: EnvServer, gateway: GatewayAdmin, scripted: Scripted, tmp_path: Path
) -> None:
    row = env_server.rows[0].model_copy(deep=True)
    row.metadata.env.url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    marker = tmp_path / "started"
    argv, _ = scripted([{"do": "pids", "path": str(marker)}])
    rollout = await play_row(row, gateway, argv)
    assert_flagged(rollout, "the episode could not be opened")
    assert rollout.status == "not_started" and rollout.agent_exit_code is None
    assert not marker.exists()  # the agent was never started


async def test_cancelling_a_rollout_closes_everything(
    gateway: GatewayAdmin, scripted: Scripted, tmp_path: Path
) -> None:
    app = build_app(GRIDSIM)
    with serve(app) as url:
        row = await _row_for(url, tmp_path)
        ready = tmp_path / "ready.fifo"
        os.mkfifo(ready)
        pids = tmp_path / "pids.json"
        argv, log = scripted(
            [
                {"do": "model"},
                {"do": "env", "vars": ["OPENAI_BASE_URL"]},
                {"do": "pids", "path": str(pids)},
                {"do": "signal", "fifo": str(ready)},
                {"do": "hang"},
            ]
        )
        play = asyncio.create_task(play_row(row, gateway, argv))
        await _until_fifo(ready, play)
        assert app.state.episodes.active == 1
        started = json.loads(pids.read_text())
        base_url = read_log(log)[0]["env"]["OPENAI_BASE_URL"]
        session_id = base_url.removesuffix("/v1").rsplit("/", 1)[1]
        assert (await gateway.view(session_id))["turns"]  # live, with the agent's turn
        play.cancel()
        with pytest.raises(asyncio.CancelledError):
            await play
        assert_group_dead(started)
        # The episode was closed before the socket (the server answered the close first).
        assert app.state.episodes.active == 0
        with pytest.raises(GatewayAdminError) as gone:
            await gateway.view(session_id)
        assert gone.value.status == 404


async def test_env_server_killed_mid_episode_fails_the_rollout(
    gateway: GatewayAdmin, scripted: Scripted, tmp_path: Path
) -> None:
    """`corral serve` SIGKILLed between two of the agent's tool calls: the second call tells
    the agent the env failed, and the rollout is flagged failed."""
    port = free_port()
    server = subprocess.Popen(  # noqa: ASYNC220 (started once; its output is read in a thread)
        [sys.executable, "-m", "corral.cli", "serve", str(GRIDSIM), "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        await asyncio.to_thread(_wait_for_line, server, "Uvicorn running on")
        row = await _row_for(f"http://127.0.0.1:{port}", tmp_path)
        ready, go = tmp_path / "ready.fifo", tmp_path / "go.fifo"
        os.mkfifo(ready)
        os.mkfifo(go)
        argv, log = scripted(
            [
                {"do": "model"},
                {"do": "tool", "name": "simulate_schedule", "arguments": {"schedule": IDLE}},
                {"do": "signal", "fifo": str(ready)},
                {"do": "wait", "fifo": str(go)},
                {"do": "tool", "name": "simulate_schedule", "arguments": {"schedule": IDLE}},
                {"do": "tool", "name": "submit_schedule", "arguments": {"schedule": IDLE}},
            ]
        )
        play = asyncio.create_task(play_row(row, gateway, argv))
        await _until_fifo(ready, play)
        server.kill()
        await asyncio.to_thread(server.wait)
        await asyncio.to_thread((go).write_text, "go")
        rollout = await play
    finally:
        _stop(server)
    assert_flagged(rollout, "the env failed")
    assert rollout.status == "error" and rollout.agent_exit_code == 0
    first, second, third = read_log(log)
    assert not first["is_error"]
    assert second["is_error"] and "the environment failed" in second["text"]
    assert third["is_error"] and "the episode is over" in third["text"]
    assert rollout.tool_calls == 2  # the call after the failure was not forwarded


# ---------------------------------------------------------------------------------------------
# corral play


def play_parser() -> argparse.ArgumentParser:
    """``corral``'s argument parser with only the ``play`` command."""
    parser = argparse.ArgumentParser(prog="corral")
    add_play_command(parser.add_subparsers(dest="command", required=True))
    return parser


def test_play_command_parses_its_arguments() -> None:
    parser = play_parser()
    args = parser.parse_args(["play", "rows.jsonl", "--gateway", "http://g", "--agent-cmd", "a b"])
    assert (args.rows, args.gateway, args.agent_cmd) == ("rows.jsonl", "http://g", "a b")
    assert (args.split, args.limit, args.concurrency, args.timeout) == (None, None, 4, 600.0)
    assert args.func is cmd_play
    with pytest.raises(SystemExit):
        parser.parse_args(["play", "rows.jsonl"])  # no --gateway
    with pytest.raises(SystemExit):
        parser.parse_args(["play", "rows.jsonl", "--gateway", "http://g", "--harness", "nope"])


def test_play_command_writes_episodes_and_prints_the_mean_reward(
    env_server: EnvServer,
    stack: StackURLs,
    scripted: Scripted,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text("".join(r.model_dump_json() + "\n" for r in env_server.rows))
    argv, log = scripted(
        [
            {"do": "env", "vars": [ADMIN_VAR]},
            {"do": "model"},
            {"do": "tool", "name": "submit_schedule", "arguments": {"schedule": IDLE}},
        ]
    )
    monkeypatch.setenv(ADMIN_VAR, ADMIN_TOKEN)
    monkeypatch.setenv(ENV_VAR, ENV_TOKEN)
    parser = play_parser()
    out = tmp_path / "out"
    args = parser.parse_args(
        [
            *("play", str(rows_file), "--gateway", stack.gateway),
            *("--agent-cmd", shlex.join(argv), "--admin-token-var", ADMIN_VAR),
            *("--split", "eval", "--limit", "2", "--concurrency", "2"),
            *("--timeout", str(AGENT_TIMEOUT_S), "--out", str(out)),
        ]
    )
    assert args.func(args) == 0
    lines = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert [x["task_id"] for x in lines] == [r.metadata.task_id for r in env_server.rows[:2]]
    for line in lines:
        assert line["failed"] is False and line["reward"] == pytest.approx(0.2)
        assert line["turns"] == 1 and line["agent_exit_code"] == 0 and line["samples"] >= 1
        assert line["scores"]["grade"] == pytest.approx(0.2)
    assert len((out / "samples.jsonl").read_text().splitlines()) == sum(x["samples"] for x in lines)
    assert "mean reward 0.2000 ± 0.0000 (standard error) over 2 scored" in capsys.readouterr().out
    # The admin token is hidden from the agent, like the env server's.
    assert all(entry["env"][ADMIN_VAR] is None for entry in read_log(log) if "env" in entry)


def test_play_command_refuses_an_unset_admin_token_variable(tmp_path: Path) -> None:
    parser = play_parser()
    args = parser.parse_args(
        [
            *("play", str(tmp_path / "rows.jsonl"), "--gateway", "http://127.0.0.1:9"),
            *("--agent-cmd", "true", "--admin-token-var", "CORRAL_TEST_UNSET_VAR"),
        ]
    )
    assert args.func(args) == 2


async def test_unset_env_token_variable_is_refused_before_anything_starts(
    env_server: EnvServer, gateway: GatewayAdmin
) -> None:
    environ = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    with pytest.raises(AgentConfigError, match=ENV_VAR):
        await play_rows_with_agent(
            env_server.rows[:1], gateway=gateway, agent_cmd="true", env=environ
        )
    with pytest.raises(AgentConfigError, match="empty"):
        await play_row(env_server.rows[0], gateway, " ")


def test_summary_leaves_failed_episodes_out_of_the_mean() -> None:
    def rollout(reward: float | None, failed: bool = False) -> AgentRollout:
        made = AgentRollout("t", "eval", 0, None, reward=reward)
        if failed:
            made.fail("x")
        return made

    summary = summarize([rollout(0.2), rollout(0.4), rollout(1.0, failed=True), rollout(None)])
    assert (summary.episodes, summary.graded, summary.failed) == (4, 2, 2)
    assert summary.mean == pytest.approx(0.3)
    assert summary.se == pytest.approx(0.1)  # stdev 0.1414 / sqrt(2)
    assert summarize([rollout(0.5)]).se is None


# ---------------------------------------------------------------------------------------------
# helpers


def _episodes(env: EnvServer, status: str) -> float:
    registry = env.app.state.episodes.metrics.registry
    return registry.get_sample_value("corral_env_episodes_total", {"status": status}) or 0.0


async def _row_for(url: str, tmp_path: Path) -> Row:
    """The first eval row of the (token-less) gridsim server at ``url``."""
    out = tmp_path / "rows"
    # write_rows runs an event loop of its own: in a thread, beside this test's.
    await asyncio.to_thread(
        write_rows, url, out, RowSettings(tool_timeout=30.0, reset_timeout=30.0)
    )
    row = read_rows(out / "eval.jsonl")[0]
    assert row.metadata.env.token_var is None
    return row


async def _until_fifo(fifo: Path, play: asyncio.Task[AgentRollout]) -> None:
    """Wait until the agent writes to ``fifo``; fail (with the rollout) if it ends first."""
    reading = asyncio.create_task(asyncio.to_thread(fifo.read_text))
    await asyncio.wait({reading, play}, return_when=asyncio.FIRST_COMPLETED)
    if not reading.done():
        # Release the reader thread: a writer that opens and closes gives it end of file.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        await reading
        pytest.fail(f"the rollout ended before the agent got there: {play.result().summary()}")


def _wait_for_line(proc: subprocess.Popen[str], marker: str) -> None:
    """Read ``proc``'s stderr until a line holds ``marker`` (the rest is drained in a thread
    so the server never blocks on a full pipe)."""
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if marker in line:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return
    pytest.fail("the server exited before serving:\n" + "".join(seen))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
