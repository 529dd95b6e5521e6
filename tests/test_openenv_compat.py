"""An OpenEnv client (``openenv-core``'s own ``GenericEnvClient``) plays a gridsim episode.

openenv-core lives in its own venv (its deps may conflict with ours): create it with
``scripts/openenv_venv.sh .openenv-venv`` or point ``CORRAL_OPENENV_PYTHON`` at a python that
has ``openenv-core`` installed. Without one the test skips.

Wire note: OpenEnv's own ``reset()`` sends ``{"type": "reset", "data": {}}`` (or ``seed`` /
``episode_id``): the server then plays its default split (``seed`` mod its size, else in
turn); ``split``/``index`` passed as reset keyword arguments, which OpenEnv forwards as
``data`` verbatim, name a task.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from corral.envs.bundle import load_bundle
from corral.envs.server import build_app
from tests.servers import serve

ROOT = Path(__file__).resolve().parents[1]
GRIDSIM = ROOT / "bundles" / "gridsim"
DEFAULT_PYTHON = ROOT / ".openenv-venv" / "bin" / "python"

CLIENT_SCRIPT = """
import asyncio, json, sys
from openenv.core import GenericEnvClient

async def main(url):
    async with GenericEnvClient(base_url=url, message_timeout_s=30) as env:
        first = await env.reset(split="eval", index=0)
        action = {"call_tool": {"name": "submit_schedule", "arguments": {"schedule": [0] * 24}}}
        last = await env.step(action)
        state = await env.state()
        plain = await env.reset()
        seeded = await env.reset(seed=7, episode_id="mine")
    print(json.dumps({
        "plain": plain.observation["task_id"],
        "seeded": seeded.observation["task_id"],
        "reset": {"observation": first.observation, "reward": first.reward, "done": first.done},
        "step": {"observation": last.observation, "reward": last.reward, "done": last.done},
        "state": state,
    }))

asyncio.run(main(sys.argv[1]))
"""


def openenv_python() -> Path | None:
    """The venv python holding openenv-core, or None (env var first, then the default path)."""
    configured = os.environ.get("CORRAL_OPENENV_PYTHON")
    if configured:
        return Path(configured)
    return DEFAULT_PYTHON if DEFAULT_PYTHON.exists() else None


def test_openenv_generic_client_plays_a_gridsim_episode() -> None:
    python = openenv_python()
    if python is None:
        pytest.skip(
            "no openenv-core venv: run `scripts/openenv_venv.sh .openenv-venv` "
            "(or set CORRAL_OPENENV_PYTHON=/path/to/venv/bin/python)"
        )
    if not python.exists():
        pytest.fail(f"CORRAL_OPENENV_PYTHON={python} does not exist")
    with serve(build_app(load_bundle(GRIDSIM), max_concurrent_envs=4)) as url:
        proc = subprocess.run(
            [str(python), "-c", CLIENT_SCRIPT, url],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": ""},
        )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    reset = result["reset"]
    assert reset["done"] is False
    assert reset["reward"] is None
    assert reset["observation"]["status"] == "running"
    assert reset["observation"]["task_id"] == "eval-0000"
    assert {t["function"]["name"] for t in reset["observation"]["tools"]} >= {
        "simulate_schedule",
        "submit_schedule",
    }

    step = result["step"]
    assert step["done"] is True
    assert step["reward"] == pytest.approx(0.2)  # the idle grade
    assert step["observation"]["status"] == "graded"
    assert step["observation"]["tool_error"] is False

    assert result["state"]["episode_id"]
    assert result["state"]["done"] is True
    # OpenEnv's own reset(): the default split, in turn or by seed
    assert result["plain"] == "train-0000"
    assert result["seeded"] == "train-0007"
