"""The env server over real sockets: corral's client, raw frames, auth, capacity, the task API."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from corral.envs.bundle import Bundle, load_bundle
from corral.envs.client import EnvClient, EnvClientError, EnvServerError, ws_url
from corral.envs.episodes import EpisodeManager, Metrics
from corral.envs.server import build_app
from tests.servers import serve

GRIDSIM = Path(__file__).resolve().parent.parent / "bundles" / "gridsim"
TOKEN = "s3cret-token"
IDLE = [0] * 24
# Charge at 03:00, sell at 18:00: valid for every gridsim battery (it starts empty).
CYCLE = [0] * 3 + [1] + [0] * 14 + [-1] + [0] * 5


@pytest.fixture(scope="module")
def bundle() -> Bundle:
    return load_bundle(GRIDSIM)


async def raw(ws: Any, message: Any) -> dict[str, Any]:
    """Send one frame (a dict as JSON, a str as is) and read the reply."""
    await ws.send(message if isinstance(message, str) else json.dumps(message))
    return dict(json.loads(await ws.recv()))


async def test_full_episode_reward_is_the_verifiers_grade(bundle: Bundle) -> None:
    with serve(build_app(bundle)) as url:
        async with EnvClient(url) as env:
            first = await env.reset(split="eval", index=0)
            assert not first.done and first.reward is None
            assert first.observation.task_id == "eval-0000"
            assert "Battery" in first.observation.prompt
            assert first.observation.system_prompt == bundle.manifest.system_prompt
            names = [t.name for t in first.observation.tools]
            assert names == ["simulate_schedule", "submit_schedule", "end_turn"]

            sim = await env.call_tool("simulate_schedule", {"schedule": CYCLE})
            assert not sim.done and not sim.observation.is_error
            assert sim.observation.tool_name == "simulate_schedule"
            assert json.loads(sim.observation.text)["valid"] is True

            end = await env.call_tool("submit_schedule", json.dumps({"schedule": CYCLE}))
            task = bundle.task("eval", 0)
            expected = bundle.grade(task, {"submitted": CYCLE})
            assert end.done and end.observation.status == "graded"
            assert end.reward == pytest.approx(expected["grade"])
            assert end.observation.scores == pytest.approx(expected)
            assert end.reward is not None and 0.2 < end.reward <= 1.0

            state = await env.state()
            assert state.done and state.env["submitted"] == CYCLE
            with pytest.raises(EnvServerError) as after:
                await env.call_tool("simulate_schedule", {"schedule": IDLE})
            assert after.value.code == "EXECUTION_ERROR" and after.value.reason == "episode_done"

            # The socket plays on: a new reset (by task id) starts a fresh episode.
            again = await env.reset(task_id="train-0001")
            assert again.observation.task_id == "train-0001" and not again.done


async def test_list_tools_and_model_mistakes_keep_the_episode_going(bundle: Bundle) -> None:
    with serve(build_app(bundle)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="train", index=3)
            tools = await env.list_tools()
            assert [t.name for t in tools][-1] == "end_turn"
            assert all(t.input_schema["type"] == "object" for t in tools)
            for bad in ([1, 2], "not json {", "[1]", 7, None):
                out = await env.call_tool("simulate_schedule", bad)
                assert out.observation.is_error and not out.done
                assert out.observation.error is not None
                assert out.observation.error.error_type == "invalid_args"
                assert "JSON" in out.observation.text
            unknown = await env.call_tool("rm_rf", {})
            assert unknown.observation.error is not None
            assert unknown.observation.error.error_type == "tool_not_found"
            assert "unknown tool" in unknown.observation.text
            env_refused = await env.call_tool("submit_schedule", {"schedule": "all"})
            # The env's own refusal: a result marked is_error, not a framework error.
            assert env_refused.observation.error is None and not env_refused.done
            assert env_refused.observation.result is not None
            assert env_refused.observation.result.is_error
            done = await env.call_tool("submit_schedule", {"schedule": IDLE})
            assert done.done and done.reward == pytest.approx(0.2)


async def test_end_turn_ends_a_single_turn_episode_and_grades_it(bundle: Bundle) -> None:
    with serve(build_app(bundle)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=1)
            out = await env.call_tool("end_turn", {"answer": "no idea"})
            assert out.done and out.observation.status == "graded"
            assert out.reward == 0.0  # no submission grades 0, like an invalid one


async def test_crashing_verifier_gives_null_reward_and_error_status(
    bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(task: Any, state: Any) -> dict[str, float]:
        raise ZeroDivisionError("verifier bug")

    crashing = load_bundle(GRIDSIM)
    monkeypatch.setattr(crashing, "_verifier", boom)
    with serve(build_app(crashing)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=0)
            out = await env.call_tool("submit_schedule", {"schedule": CYCLE})
            assert out.done and out.reward is None
            assert out.observation.status == "error"
            assert "ZeroDivisionError" in (out.observation.grade_error or "")


async def test_malformed_and_unknown_messages_echo_request_ids(bundle: Bundle) -> None:
    with serve(build_app(bundle)) as url:
        async with websockets.connect(ws_url(url)) as ws:
            assert (await raw(ws, "{nope"))["data"]["code"] == "INVALID_JSON"
            assert (await raw(ws, "[1, 2]"))["data"]["code"] == "INVALID_JSON"
            unknown = await raw(ws, {"type": "dance", "request_id": 5})
            assert unknown["data"]["code"] == "UNKNOWN_TYPE" and unknown["request_id"] == 5
            bad = await raw(ws, {"type": "reset", "data": {"split": "eval"}, "request_id": "a"})
            assert bad["data"]["code"] == "VALIDATION_ERROR" and bad["request_id"] == "a"
            two = await raw(ws, {"type": "step", "data": {"type": "call_tool"}})
            assert two["data"]["code"] == "VALIDATION_ERROR" and "request_id" not in two
            assert two["data"]["errors"][0]["loc"] == ["step", "data", "call_tool", "tool_name"]
            early = await raw(ws, {"type": "step", "data": {"type": "call_tool", "tool_name": "x"}})
            assert early["data"]["code"] == "EXECUTION_ERROR"
            assert early["data"]["reason"] == "no_episode"
            missing = await raw(ws, {"type": "reset", "data": {"split": "eval", "index": 10**6}})
            assert missing["data"]["code"] == "VALIDATION_ERROR"
            assert missing["data"]["reason"] == "task_not_found"
            ok = await raw(
                ws, {"type": "reset", "data": {"split": "eval", "index": 0}, "request_id": "r"}
            )
            assert ok["type"] == "observation" and ok["request_id"] == "r"
            assert set(ok["data"]) == {"observation", "reward", "done"}  # OpenEnv's shape
            state = await raw(ws, {"type": "state"})
            assert state["type"] == "state" and state["data"]["step_count"] == 0
            await ws.send(json.dumps({"type": "close"}))
            await ws.wait_closed()


async def test_auth_matrix(bundle: Bundle) -> None:
    with serve(build_app(bundle, token=TOKEN, max_concurrent_envs=1)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/health")).status_code == 200
            for path in ("/splits", "/tasks/eval", "/tasks/eval/0", "/metrics"):
                assert (await http.get(path)).status_code == 401
                wrong = {"Authorization": "Bearer nope"}
                assert (await http.get(path, headers=wrong)).status_code == 401
                right = {"Authorization": f"Bearer {TOKEN}"}
                assert (await http.get(path, headers=right)).status_code == 200
        for token in (None, "wrong"):
            with pytest.raises(EnvClientError, match="1008"):
                async with EnvClient(url, token) as env:
                    await env.reset(split="eval", index=0)
        async with EnvClient(url, TOKEN) as env:
            # Capacity is 1: the refused sockets above created no episode.
            out = await env.reset(split="eval", index=0)
            assert not out.done


async def test_capacity_wait_then_room(bundle: Bundle) -> None:
    app = build_app(bundle, max_concurrent_envs=1, reset_timeout=30)
    waiting = threading.Event()
    manager: EpisodeManager = app.state.episodes
    manager.on_capacity_wait = waiting.set
    with serve(app) as url:
        first = EnvClient(url)
        await first.reset(split="eval", index=0)
        async with EnvClient(url) as second:
            pending = asyncio.create_task(second.reset(split="eval", index=1))
            assert await asyncio.to_thread(waiting.wait, 10)
            assert not pending.done()
            await first.close()  # frees the only slot
            out = await asyncio.wait_for(pending, 10)
            assert out.observation.task_id == "eval-0001"


async def test_capacity_timeout(bundle: Bundle) -> None:
    with serve(build_app(bundle, max_concurrent_envs=1, reset_timeout=0.2)) as url:
        async with EnvClient(url) as first, EnvClient(url) as second:
            await first.reset(split="eval", index=0)
            with pytest.raises(EnvServerError) as full:
                await second.reset(split="eval", index=1)
            assert full.value.code == "CAPACITY_REACHED"
            assert full.value.data["active_sessions"] == 1
            assert full.value.data["max_sessions"] == 1


async def test_task_api_and_metrics(bundle: Bundle) -> None:
    with serve(build_app(bundle)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            splits = (await http.get("/splits")).json()["splits"]
            assert {s["name"]: s["tasks"] for s in splits} == {"train": 2000, "eval": 200}
            listed = (await http.get("/tasks/eval")).json()
            assert listed["tasks"][0] == {"index": 0, "id": "eval-0000"}
            assert len(listed["tasks"]) == 200
            one = (await http.get("/tasks/eval/5")).json()
            assert one["id"] == "eval-0005" and one["prompt"] == bundle.task("eval", 5).prompt
            assert one["system_prompt"] == bundle.manifest.system_prompt
            assert one["tools"][-1]["function"]["name"] == "end_turn"
            assert (await http.get("/tasks/nope")).status_code == 404
            assert (await http.get("/tasks/eval/999")).status_code == 404
            async with EnvClient(url) as env:
                await env.reset(split="eval", index=0)
                await env.call_tool("submit_schedule", {"schedule": IDLE})
            text = (await http.get("/metrics")).text
            assert 'corral_env_episodes_total{status="graded"} 1.0' in text


async def test_tool_timeout_ends_the_episode(
    bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = load_bundle(GRIDSIM)
    release = threading.Event()
    real = getattr(slow.env_class, "call_tool")  # noqa: B009  # a class only known at runtime

    def stuck(self: Any, name: str, arguments: Any) -> Any:
        release.wait(10)  # released below, so the worker thread ends with the test
        return real(self, name, arguments)

    monkeypatch.setattr(slow.env_class, "call_tool", stuck)
    try:
        with serve(build_app(slow, tool_timeout=0.2)) as url:
            async with EnvClient(url) as env:
                await env.reset(split="eval", index=0)
                late = await env.call_tool("simulate_schedule", {"schedule": IDLE})
                # An observation, not an error frame: the episode is over, with no reward.
                assert late.done and late.reward is None
                assert late.observation.status == "error"
                assert late.observation.error is not None
                assert late.observation.error.error_type == "timeout"
                assert "0.2 s" in late.observation.text
                with pytest.raises(EnvServerError) as after:
                    await env.call_tool("simulate_schedule", {"schedule": IDLE})
                assert after.value.reason == "episode_done"
            # Free the stuck worker before the server stops: its loop waits for its threads.
            release.set()
    finally:
        release.set()


async def test_idle_episodes_are_reaped(bundle: Bundle) -> None:
    manager = EpisodeManager(
        bundle,
        max_concurrent_envs=2,
        reset_timeout=1,
        idle_timeout=5,
        tool_timeout=5,
        metrics=Metrics(),
    )
    episode, _ = await manager.open(bundle.task("eval", 0))
    assert await manager.reap_idle(now=time.monotonic()) == 0
    episode.busy = True
    assert await manager.reap_idle(now=time.monotonic() + 60) == 0
    episode.busy = False
    assert await manager.reap_idle(now=time.monotonic() + 60) == 1
    assert manager.active == 0 and not manager.is_open(episode)


async def test_build_app_reward_override_and_failing_reward(bundle: Bundle) -> None:
    """``reward=`` replaces the bundle's combination; one that raises flags the episode."""
    doubled = build_app(bundle, reward=lambda scores: 2 * scores["grade"])
    with serve(doubled) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=0)
            out = await env.call_tool("submit_schedule", {"schedule": [0] * 24})
    assert out.reward == pytest.approx(0.4) and out.done

    def broken(scores: dict[str, float]) -> float:
        raise KeyError("no such score")

    with serve(build_app(bundle, reward=broken)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=0)
            out = await env.call_tool("submit_schedule", {"schedule": [0] * 24})
    assert out.reward is None and out.done
    assert out.observation.status == "error"
    with pytest.raises(ValueError, match="unknown sandbox backend 'podman'"):
        build_app(bundle, sandbox="podman")
