"""OpenEnv's own clients (``openenv-core``'s ``MCPToolClient`` and ``GenericEnvClient``, and its
``openenv validate --url`` checks) play corral's env server, changing nothing but the URL.

openenv-core lives in its own venv (its deps may conflict with ours): create it with
``scripts/openenv_venv.sh .openenv-venv`` or point ``CORRAL_OPENENV_PYTHON`` at a python that
has ``openenv-core`` installed. Without one the tests skip. Each test runs one script in that
venv against a real server on 127.0.0.1 and checks what the script printed (one JSON line):
gridsim with both clients, shellcraft in bwrap with both, bad input through
``GenericEnvClient`` (the error codes it surfaces are OpenEnv's ``WSErrorCode``, which corral's
``ErrorCode`` must equal).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bundles.shellcraft.solver import solve
from corral.envs.bundle import load_bundle
from corral.envs.server import build_app
from tests.servers import serve

ROOT = Path(__file__).resolve().parents[1]
GRIDSIM = ROOT / "bundles" / "gridsim"
SHELLCRAFT = ROOT / "bundles" / "shellcraft"
DEFAULT_PYTHON = ROOT / ".openenv-venv" / "bin" / "python"
# Charge at 03:00, sell at 18:00: valid for every gridsim battery (it starts empty).
CYCLE = [0] * 3 + [1] + [0] * 14 + [-1] + [0] * 5

# MCPToolClient in its default (WebSocket) mode, then GenericEnvClient, on gridsim.
GRIDSIM_SCRIPT = """
import asyncio, json, sys
from openenv.core import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient
from openenv.core.env_server.mcp_types import CallToolAction

async def main(url, cycle):
    out = {}
    async with MCPToolClient(base_url=url, message_timeout_s=30) as env:
        listed_early = await env.list_tools(use_cache=False)  # OpenEnv: no reset needed
        out["early_tools"] = [t.name for t in listed_early]
        first = await env.reset(split="eval", index=0)
        out["reset_done"] = first.done
        tools = await env.list_tools(use_cache=False)
        out["tools"] = [t.model_dump() for t in tools]
        out["simulated"] = await env.call_tool("simulate_schedule", schedule=cycle)
        try:
            await env.call_tool("rm_rf")
        except RuntimeError as exc:
            out["unknown_tool"] = str(exc)
        last = await env.step(CallToolAction(tool_name="submit_schedule",
                                             arguments={"schedule": cycle}))
        out["mcp_end"] = {"reward": last.reward, "done": last.done,
                          "result": last.observation.result}
        state = await env.state()
        out["mcp_state"] = {"episode_id": state.episode_id, "step_count": state.step_count}
    async with GenericEnvClient(base_url=url, message_timeout_s=30) as env:
        first = await env.reset(split="eval", index=1)
        out["generic_reset"] = first.observation
        last = await env.step({"type": "call_tool", "tool_name": "submit_schedule",
                               "arguments": {"schedule": cycle}})
        out["generic_end"] = {"observation": last.observation, "reward": last.reward,
                              "done": last.done}
        out["generic_state"] = await env.state()
        out["plain"] = (await env.reset()).observation["task_id"]
        out["seeded"] = (await env.reset(seed=7, episode_id="mine")).observation
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
"""

# MCPToolClient in production mode: JSON-RPC over POST /mcp (session create, tools/list,
# tools/call, session close).
PRODUCTION_SCRIPT = """
import asyncio, json, sys
from openenv.core.mcp_client import MCPToolClient

async def main(url, cycle):
    env = MCPToolClient(base_url=url, message_timeout_s=30)
    env.use_production_mode = True
    tools = await env.list_tools(use_cache=False)
    simulated = await env.call_tool("simulate_schedule", schedule=cycle)
    session = env._production_session_id
    try:
        await env.call_tool("rm_rf")
    except RuntimeError as exc:
        unknown = str(exc)
    submitted = await env.call_tool("submit_schedule", schedule=cycle)
    await env.close()
    print(json.dumps({"tools": [t.name for t in tools], "simulated": simulated,
                      "session": session, "unknown": unknown, "submitted": submitted}))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
"""

VALIDATE_SCRIPT = """
import json, sys
from openenv.cli._validation import validate_running_environment
print(json.dumps(validate_running_environment(sys.argv[1], timeout_s=10)))
"""

# MCPToolClient plays shellcraft's reference commands through bash, then submits.
SHELLCRAFT_SCRIPT = """
import asyncio, json, sys
from openenv.core.mcp_client import MCPToolClient
from openenv.core.env_server.mcp_types import CallToolAction

async def main(url, commands):
    async with MCPToolClient(base_url=url, message_timeout_s=60) as env:
        await env.reset(split="eval", index=0)
        outputs = [await env.call_tool("bash", command=c) for c in commands]
        last = await env.step(CallToolAction(tool_name="submit", arguments={}))
    print(json.dumps({"outputs": outputs, "reward": last.reward, "done": last.done}))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
"""


# GenericEnvClient (plain dicts, no MCP) plays shellcraft: the reference commands as bash
# steps, then submit; each step's observation and the state as the client parsed them.
SHELLCRAFT_GENERIC_SCRIPT = """
import asyncio, json, sys
from openenv.core import GenericEnvClient

async def main(url, commands):
    out = {"steps": []}
    async with GenericEnvClient(base_url=url, message_timeout_s=60) as env:
        first = await env.reset(split="eval", index=0)
        out["reset"] = {"observation": first.observation, "done": first.done}
        for c in commands:
            r = await env.step({"type": "call_tool", "tool_name": "bash",
                                "arguments": {"command": c}})
            out["steps"].append({"observation": r.observation, "done": r.done,
                                 "reward": r.reward})
        last = await env.step({"type": "call_tool", "tool_name": "submit", "arguments": {}})
        out["end"] = {"observation": last.observation, "reward": last.reward, "done": last.done}
        out["state"] = await env.state()
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
"""

# Bad input through GenericEnvClient's own connection and error path: the error each surfaces
# (the client raises RuntimeError "... (code: X)"; a frame that is not JSON goes out on the
# client's socket and its answer is read by the client's own receive), and OpenEnv's
# WSErrorCode members, for comparison with corral's ErrorCode.
BAD_INPUT_SCRIPT = """
import asyncio, json, re, sys
from openenv.core import GenericEnvClient
from openenv.core.env_server.types import WSErrorCode

def code(exc):
    found = re.search(r"\\(code: ([A-Z_]+)\\)$", str(exc))
    return found.group(1) if found else "no code in: " + str(exc)

async def raised(op):
    try:
        await op
    except RuntimeError as exc:
        return {"code": code(exc), "message": str(exc)}
    return {"code": None, "message": "no error"}

async def main(url):
    out = {"ws_error_codes": {m.name: m.value for m in WSErrorCode}}
    async with GenericEnvClient(base_url=url, message_timeout_s=30) as env:
        await env.connect()
        await env._ws.send("{not json")
        out["bad_json"] = (await env._receive())["data"]
        out["unknown_type"] = await raised(env._send_and_receive({"type": "teleport"}))
        out["no_task"] = await raised(env.reset(split="eval", index=10**6))
        out["no_tool_name"] = await raised(env.step({"type": "call_tool", "arguments": {}}))
        out["after_errors"] = (await env.reset(split="eval", index=0)).observation["status"]
        async with GenericEnvClient(base_url=url, message_timeout_s=30) as other:
            out["capacity"] = await raised(other.reset(split="eval", index=1))
    print(json.dumps(out))

asyncio.run(main(sys.argv[1]))
"""


def openenv_python() -> Path:
    """The venv python holding openenv-core (env var first, then the default path); skips
    the test when there is none."""
    configured = os.environ.get("CORRAL_OPENENV_PYTHON")
    python = Path(configured) if configured else DEFAULT_PYTHON
    if configured and not python.exists():
        pytest.fail(f"CORRAL_OPENENV_PYTHON={python} does not exist")
    if not python.exists():
        pytest.skip(
            "no openenv-core venv: run `scripts/openenv_venv.sh .openenv-venv` "
            "(or set CORRAL_OPENENV_PYTHON=/path/to/venv/bin/python)"
        )
    return python


def run_openenv(script: str, *args: str, timeout: float = 120) -> Any:
    """Run ``script`` in the OpenEnv venv; the JSON it printed last."""
    proc = subprocess.run(
        [str(openenv_python()), "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_openenv_clients_play_gridsim_over_the_socket() -> None:
    bundle = load_bundle(GRIDSIM)
    with serve(build_app(bundle, max_concurrent_envs=4)) as url:
        out = run_openenv(GRIDSIM_SCRIPT, url, json.dumps(CYCLE))

    assert out["early_tools"] == ["simulate_schedule", "submit_schedule", "end_turn"]
    assert out["reset_done"] is False
    assert [t["name"] for t in out["tools"]] == out["early_tools"]
    assert out["tools"][0]["input_schema"]["type"] == "object"
    assert json.loads(out["simulated"])["valid"] is True
    assert "tool_not_found" in out["unknown_tool"] and "rm_rf" in out["unknown_tool"]

    expected = bundle.reward(bundle.grade(bundle.task("eval", 0), {"submitted": CYCLE}))
    end = out["mcp_end"]
    assert end["done"] is True and end["reward"] == pytest.approx(expected)
    assert end["result"]["is_error"] is False and "submitted" in end["result"]["data"]
    assert out["mcp_state"]["step_count"] == 3 and out["mcp_state"]["episode_id"]

    reset = out["generic_reset"]
    assert reset["task_id"] == "eval-0001" and reset["status"] == "running"
    assert reset["system_prompt"] == bundle.manifest.system_prompt and reset["prompt"]
    expected = bundle.reward(bundle.grade(bundle.task("eval", 1), {"submitted": CYCLE}))
    gend = out["generic_end"]
    assert gend["done"] is True and gend["reward"] == pytest.approx(expected)
    assert gend["observation"]["status"] == "graded"
    assert gend["observation"]["tool_name"] == "submit_schedule"
    assert gend["observation"]["error"] is None
    assert out["generic_state"]["done"] is True
    assert out["generic_state"]["env"]["submitted"] == CYCLE
    # OpenEnv's own reset(): the default split, in turn or by seed; the client's episode id
    assert out["plain"] == "train-0000"
    assert out["seeded"]["task_id"] == "train-0007" and out["seeded"]["episode_id"] == "mine"


def test_openenv_production_mode_plays_over_post_mcp() -> None:
    bundle = load_bundle(GRIDSIM)
    app = build_app(bundle, max_concurrent_envs=4)
    with serve(app) as url:
        out = run_openenv(PRODUCTION_SCRIPT, url, json.dumps(CYCLE))
        active_after = app.state.episodes.active
    assert out["tools"] == ["simulate_schedule", "submit_schedule", "end_turn"]
    assert json.loads(out["simulated"])["valid"] is True
    assert out["session"]
    assert "Tool 'rm_rf' failed" in out["unknown"] and "unknown tool" in out["unknown"]
    assert "submitted" in out["submitted"]
    assert active_after == 0  # graded, then the session closed: nothing left open


def test_openenv_validate_passes_against_a_corral_server() -> None:
    with serve(build_app(load_bundle(GRIDSIM))) as url:
        report = run_openenv(VALIDATE_SCRIPT, url)
    failed = [c for c in report["criteria"] if not c["passed"]]
    assert report["passed"] is True, failed
    assert report["mode"] == "simulation"
    assert report["standard_version"] == load_bundle(GRIDSIM).manifest.version


def test_openenv_mcp_tool_client_plays_shellcraft_in_bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    bundle = load_bundle(SHELLCRAFT)
    commands = solve(bundle.task("eval", 0).data)
    with serve(build_app(bundle, sandbox="bwrap")) as url:
        out = run_openenv(SHELLCRAFT_SCRIPT, url, json.dumps(commands), timeout=300)
    assert len(out["outputs"]) == len(commands)
    assert all(isinstance(o, str) for o in out["outputs"])
    assert out["done"] is True and out["reward"] == pytest.approx(1.0)


def test_openenv_generic_client_plays_shellcraft_in_bwrap() -> None:
    """``GenericEnvClient`` (plain dict actions, no MCP client) on a sandboxed bundle: each
    reference command a ``call_tool`` step of ``bash``, then ``submit``, graded 1."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    bundle = load_bundle(SHELLCRAFT)
    task = bundle.task("eval", 0)
    commands = solve(task.data)
    with serve(build_app(bundle, sandbox="bwrap")) as url:
        out = run_openenv(SHELLCRAFT_GENERIC_SCRIPT, url, json.dumps(commands), timeout=300)
    reset = out["reset"]
    assert reset["done"] is False and reset["observation"]["task_id"] == task.id
    assert reset["observation"]["status"] == "running" and reset["observation"]["prompt"]
    steps = out["steps"]
    assert len(steps) == len(commands)
    for step in steps:
        assert step["done"] is False and step["observation"]["tool_name"] == "bash", step
        assert step["observation"]["error"] is None, step
    end = out["end"]
    assert end["done"] is True and end["reward"] == pytest.approx(1.0), end
    assert end["observation"]["status"] == "graded" and end["observation"]["tool_name"] == "submit"
    assert out["state"]["done"] is True


def test_openenv_generic_client_surfaces_corrals_error_codes() -> None:
    """Bad input through OpenEnv's own client: a frame that is not JSON, an unknown message
    type, two validation errors (no such task; a step without a tool name), and a second
    client past ``max_concurrent_envs=1``: each answer's code is one of OpenEnv's, and the
    connection still plays afterwards. corral's ``ErrorCode`` is exactly the installed
    openenv-core's ``WSErrorCode``."""
    from corral.envs.protocol import ErrorCode

    bundle = load_bundle(GRIDSIM)
    app = build_app(bundle, max_concurrent_envs=1, reset_timeout=0.5)
    with serve(app) as url:
        out = run_openenv(BAD_INPUT_SCRIPT, url)
    assert out["ws_error_codes"] == {m.name: m.value for m in ErrorCode}
    assert out["bad_json"]["code"] == ErrorCode.INVALID_JSON, out["bad_json"]
    assert out["unknown_type"]["code"] == ErrorCode.UNKNOWN_TYPE, out["unknown_type"]
    assert "teleport" in out["unknown_type"]["message"]
    assert out["no_task"]["code"] == ErrorCode.VALIDATION_ERROR, out["no_task"]
    assert out["no_tool_name"]["code"] == ErrorCode.VALIDATION_ERROR, out["no_tool_name"]
    assert out["after_errors"] == "running"  # the errors ended nothing: it still plays
    assert out["capacity"]["code"] == ErrorCode.CAPACITY_REACHED, out["capacity"]
    assert "1 of 1" in out["capacity"]["message"]
