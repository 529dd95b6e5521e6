"""The env server's wire format against bad input, over real sockets and HTTP on 127.0.0.1:
every bad frame, body or JSON-RPC request gets OpenEnv's code (and corral's ``reason``), and
after each one the live episode still answers. Also HTTP episodes, ``/mcp``, the bounds of the
bundle's ``[limits]``, tokens on every route, and sockets that never play."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from corral.envs.bundle import Bundle, load_bundle
from corral.envs.client import EnvClient, EnvServerError, ws_url
from corral.envs.server import build_app
from tests.servers import serve

GRIDSIM = Path(__file__).resolve().parent.parent / "bundles" / "gridsim"
TOKEN = "s3cret-token"
IDLE = [0] * 24
MAX_CALL_BYTES = 256
MAX_STATE_BYTES = 1024


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    """gridsim with tight ``[limits]``: 256 bytes of arguments, 1 KiB of state."""
    root = tmp_path_factory.mktemp("bundle") / "gridsim"
    shutil.copytree(GRIDSIM, root)
    manifest = root / "bundle.toml"
    manifest.write_text(
        manifest.read_text()
        + f"\n[limits]\nmax_call_bytes = {MAX_CALL_BYTES}\nmax_state_bytes = {MAX_STATE_BYTES}\n"
    )
    return load_bundle(root)


async def rpc_ws(ws: Any, message: Any) -> dict[str, Any]:
    """Send one frame (a dict as JSON, a str as is) and read the reply."""
    await ws.send(message if isinstance(message, str) else json.dumps(message))
    return dict(json.loads(await ws.recv()))


def simulate(arguments: Any = None) -> dict[str, Any]:
    args = {"schedule": IDLE} if arguments is None else arguments
    return {
        "type": "step",
        "data": {"type": "call_tool", "tool_name": "simulate_schedule", "arguments": args},
    }


def nested(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


# (frame, code, reason): each refused with an error frame, the episode untouched.
BAD_FRAMES: list[tuple[str, Any, str, str | None]] = [
    ("malformed JSON", "{nope", "INVALID_JSON", None),
    ("not an object", "[1, 2]", "INVALID_JSON", None),
    ("deep nesting past the parser", "[" * 100_000, "INVALID_JSON", None),
    ("unknown type", {"type": "dance"}, "UNKNOWN_TYPE", None),
    (
        "old corral call shape",
        {"type": "step", "data": {"call_tool": {"name": "simulate_schedule"}}},
        "VALIDATION_ERROR",
        "old_shape",
    ),
    (
        "old corral list shape",
        {"type": "step", "data": {"list_tools": {}}},
        "VALIDATION_ERROR",
        "old_shape",
    ),
    (
        "unknown action field",
        {"type": "step", "data": {"type": "call_tool", "tool_name": "x", "args": {}}},
        "VALIDATION_ERROR",
        None,
    ),
    (
        "tool_name not a string",
        {"type": "step", "data": {"type": "call_tool", "tool_name": 5}},
        "VALIDATION_ERROR",
        None,
    ),
    ("unknown action type", {"type": "step", "data": {"type": "jump"}}, "VALIDATION_ERROR", None),
    ("deep nesting in arguments", simulate({"a": nested(100)}), "VALIDATION_ERROR", "too_deep"),
    (
        "reset naming half a task",
        {"type": "reset", "data": {"split": "eval"}},
        "VALIDATION_ERROR",
        None,
    ),
    (
        "unknown task",
        {"type": "reset", "data": {"task_id": "no-such-task"}},
        "VALIDATION_ERROR",
        "task_not_found",
    ),
]


async def test_bad_frames_get_openenv_codes_and_the_episode_lives() -> None:
    with serve(build_app(load_bundle(GRIDSIM))) as url:
        async with websockets.connect(ws_url(url), max_size=2**22) as ws:
            first = await rpc_ws(ws, {"type": "reset", "data": {"split": "eval", "index": 0}})
            episode_id = first["data"]["observation"]["episode_id"]
            for steps, (what, frame, code, reason) in enumerate(BAD_FRAMES, start=1):
                reply = await rpc_ws(ws, frame)
                assert reply["type"] == "error", what
                assert reply["data"]["code"] == code, (what, reply)
                assert reply["data"].get("reason") == reason, (what, reply)
                if code == "VALIDATION_ERROR":
                    assert isinstance(reply["data"]["errors"], list), what
                if reason == "old_shape":
                    assert '"tool_name"' in reply["data"]["message"]
                # The live episode still answers, and nothing was counted against it.
                alive = await rpc_ws(ws, simulate())
                assert alive["type"] == "observation", (what, alive)
                assert alive["data"]["observation"]["step"] == steps, what
            state = await rpc_ws(ws, {"type": "state"})
            assert state["data"]["episode_id"] == episode_id


# (arguments or tool, error_type): the model's mistakes, answered as tool errors.
TOOL_MISTAKES: list[tuple[str, str, Any, str, str]] = [
    ("unknown tool", "rm_rf", {}, "tool_not_found", "unknown tool 'rm_rf'"),
    ("arguments an array", "simulate_schedule", [1], "invalid_args", "JSON object"),
    ("arguments a number", "simulate_schedule", 7, "invalid_args", "JSON object"),
    ("arguments bad JSON text", "simulate_schedule", "{no", "invalid_args", "not valid JSON"),
    (
        "arguments over max_call_bytes",
        "simulate_schedule",
        {"schedule": [0] * 200},
        "invalid_args",
        "max_call_bytes",
    ),
]


async def test_tool_mistakes_are_tool_errors_and_the_episode_goes_on(small: Bundle) -> None:
    with serve(build_app(small)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=0)
            for what, tool, arguments, error_type, text in TOOL_MISTAKES:
                out = await env.call_tool(tool, arguments)
                assert not out.done and out.observation.status == "running", what
                assert out.observation.error is not None, what
                assert out.observation.error.error_type == error_type, what
                assert text in out.observation.text, (what, out.observation.text)
                assert out.observation.result is None and out.observation.is_error
            ok = await env.call_tool("simulate_schedule", {"schedule": IDLE})
            assert not ok.observation.is_error
            assert ok.observation.step == len(TOOL_MISTAKES) + 1


async def test_steps_with_no_episode_or_after_the_end(small: Bundle) -> None:
    with serve(build_app(small)) as url:
        async with websockets.connect(ws_url(url)) as ws:
            for frame in (simulate(), {"type": "state"}):
                early = await rpc_ws(ws, frame)
                assert early["data"]["code"] == "EXECUTION_ERROR"
                assert early["data"]["reason"] == "no_episode"
            # list_tools needs no reset (OpenEnv): the bundle's tools.
            listed = await rpc_ws(ws, {"type": "step", "data": {"type": "list_tools"}})
            names = [t["name"] for t in listed["data"]["observation"]["tools"]]
            assert names == ["simulate_schedule", "submit_schedule", "end_turn"]
            await rpc_ws(ws, {"type": "reset", "data": {"split": "eval", "index": 0}})
            submit = {"type": "call_tool", "tool_name": "submit_schedule"}
            done = await rpc_ws(
                ws, {"type": "step", "data": {**submit, "arguments": {"schedule": IDLE}}}
            )
            assert done["data"]["done"] is True
            after = await rpc_ws(ws, simulate())
            assert after["data"]["code"] == "EXECUTION_ERROR"
            assert after["data"]["reason"] == "episode_done"
            state = await rpc_ws(ws, {"type": "state"})  # the final state stays readable
            assert state["data"]["status"] == "graded"


async def test_a_state_over_max_state_bytes_ends_the_episode(small: Bundle) -> None:
    with serve(build_app(small)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=0)
            # Every simulation is recorded in the state: a dozen pass 1 KiB.
            for _ in range(12):
                await env.call_tool("simulate_schedule", {"schedule": IDLE})
            with pytest.raises(EnvServerError) as big:
                await env.state()
            assert big.value.code == "EXECUTION_ERROR"
            assert big.value.reason == "state_too_large"
            assert str(MAX_STATE_BYTES) in str(big.value) and "max_state_bytes" in str(big.value)
            with pytest.raises(EnvServerError) as after:
                await env.call_tool("simulate_schedule", {"schedule": IDLE})
            assert after.value.reason in ("episode_done", "no_episode")

            await env.reset(split="eval", index=0)
            for _ in range(12):
                await env.call_tool("simulate_schedule", {"schedule": IDLE})
            end = await env.call_tool("submit_schedule", {"schedule": IDLE})
            assert end.done and end.reward is None and end.observation.status == "error"
            assert "max_state_bytes" in (end.observation.grade_error or "")


async def test_http_episodes(small: Bundle) -> None:
    app = build_app(small, max_concurrent_envs=2, reset_timeout=0.3)
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            first = (await http.post("/reset", json={"split": "eval", "index": 0})).json()
            assert set(first) == {"observation", "reward", "done"}
            episode_id = first["observation"]["episode_id"]
            mine = (await http.post("/reset", json={"episode_id": "mine", "seed": 3})).json()
            assert mine["observation"]["episode_id"] == "mine"
            assert mine["observation"]["task_id"] == "train-0003"

            # Capacity is shared with sockets: both slots are taken.
            full = await http.post("/reset", json={})
            assert full.status_code == 503
            assert full.json()["detail"]["code"] == "CAPACITY_REACHED"
            assert full.json()["detail"]["active_sessions"] == 2
            async with EnvClient(url, reset_timeout=5) as env:
                with pytest.raises(EnvServerError) as ws_full:
                    await env.reset(split="eval", index=1)
                assert ws_full.value.code == "CAPACITY_REACHED"

            step = {"type": "call_tool", "tool_name": "simulate_schedule"}
            sim = await http.post(
                "/step",
                json={
                    "action": {**step, "arguments": {"schedule": IDLE}},
                    "episode_id": episode_id,
                },
            )
            assert sim.status_code == 200 and sim.json()["observation"]["step"] == 1
            listed = await http.post(
                "/step", json={"action": {"type": "list_tools"}, "episode_id": episode_id}
            )
            assert listed.json()["observation"]["tools"][-1]["name"] == "end_turn"

            bad = [
                ({"action": step, "episode_id": "nope"}, 404, "no_episode"),
                ({"action": step}, 404, "no_episode"),
                ({"action": {"call_tool": {"name": "x"}}, "episode_id": episode_id}, 422, None),
                ({"action": {"type": "call_tool"}, "episode_id": episode_id}, 422, None),
                ({"episode_id": episode_id}, 422, None),
                ("{nope", 400, None),
            ]
            for body, status, reason in bad:
                kwargs = {"content": body} if isinstance(body, str) else {"json": body}
                reply = await http.post("/step", **kwargs)  # type: ignore[arg-type]
                assert reply.status_code == status, (body, reply.text)
                assert reply.json()["detail"].get("reason") == reason, body
                # The episode still answers.
                state = await http.get("/state", params={"episode_id": episode_id})
                assert state.status_code == 200 and state.json()["step_count"] == 1
            assert (await http.get("/state", params={"episode_id": "nope"})).status_code == 404
            assert (await http.get("/state")).status_code == 404

            submit = {"type": "call_tool", "tool_name": "submit_schedule"}
            end = await http.post(
                "/step",
                json={
                    "action": {**submit, "arguments": {"schedule": IDLE}},
                    "episode_id": episode_id,
                },
            )
            assert end.json()["done"] is True and end.json()["reward"] == pytest.approx(0.2)
            after = await http.post(
                "/step", json={"action": {**step, "arguments": {}}, "episode_id": episode_id}
            )
            assert after.status_code == 409 and after.json()["detail"]["reason"] == "episode_done"
            # The slot freed by the graded episode is free for anyone.
            assert (await http.post("/reset", content=b"")).status_code == 200


def rpc(method: str, params: dict[str, Any] | None = None, rid: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params or {}, "id": rid}


async def test_json_rpc_errors_and_sessions() -> None:
    # One slot: each part below waits (event-driven) for the one before to let its episode go.
    app = build_app(load_bundle(GRIDSIM), max_concurrent_envs=1, reset_timeout=10)
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url) as http:

            async def post(body: Any) -> dict[str, Any]:
                kwargs = {"content": body} if isinstance(body, str) else {"json": body}
                reply = await http.post("/mcp", **kwargs)  # type: ignore[arg-type]
                assert reply.status_code == 200
                return dict(reply.json())

            created = await post(rpc("openenv/session/create", {"split": "eval", "index": 0}))
            session = created["result"]["session_id"]
            cases: list[tuple[Any, int]] = [
                ("{nope", -32700),
                ("[" * 100_000, -32700),
                ({}, -32600),
                ({"jsonrpc": "1.0", "method": "tools/list", "id": 1}, -32600),
                ({"jsonrpc": "2.0", "method": "tools/list", "params": [1], "id": 1}, -32600),
                (rpc("resources/list"), -32601),
                (rpc("tools/call", {"session_id": session}), -32602),
                (rpc("tools/call", {"name": "simulate_schedule", "session_id": "nope"}), -32602),
                (rpc("tools/call", {"name": "simulate_schedule"}), -32602),
                (rpc("tools/call", {"name": "rm_rf", "session_id": session}), -32602),
                (rpc("tools/list", {"session_id": "nope"}), -32602),
                (rpc("openenv/session/close", {}), -32602),
                (rpc("openenv/session/close", {"session_id": "nope"}), -32602),
                (rpc("openenv/session/create", {"task_id": "no-such-task"}), -32602),
                (rpc("openenv/session/create", {"split": "eval"}), -32602),
            ]
            calls = 0
            for body, code in cases:
                reply = await post(body)
                assert reply["jsonrpc"] == "2.0" and "result" not in reply, body
                assert reply["error"]["code"] == code, (str(body)[:80], reply)
                if body == cases[9][0]:
                    calls += 1  # an unknown tool reached the episode (and was counted)
                # The session still plays.
                sim = {"name": "simulate_schedule", "arguments": {"schedule": IDLE}}
                ok = await post(rpc("tools/call", {**sim, "session_id": session}))
                calls += 1
                assert ok["result"]["is_error"] is False and json.loads(ok["result"]["data"])
            listed = await post(rpc("tools/list"))  # no session needed
            assert [t["name"] for t in listed["result"]["tools"]][-1] == "end_turn"
            state = (await http.get("/state", params={"episode_id": session})).json()
            assert state["step_count"] == calls
            closed = await post(rpc("openenv/session/close", {"session_id": session}))
            assert closed["result"] == {"session_id": session, "closed": True}
            assert app.state.episodes.active == 0

        # JSON-RPC over /ws (OpenEnv's "mcp" frames): the socket's own episode.
        async with websockets.connect(ws_url(url)) as ws:
            await rpc_ws(ws, {"type": "reset", "data": {"split": "eval", "index": 0}})
            wrapped = await rpc_ws(ws, {"type": "mcp", "data": rpc("nope/nope")})
            assert wrapped["type"] == "mcp" and wrapped["data"]["error"]["code"] == -32601
            bad = await rpc_ws(ws, {"type": "mcp", "data": [1]})
            assert bad["data"]["error"]["code"] == -32600
            call = {"name": "simulate_schedule", "arguments": {"schedule": IDLE}}
            ok = await rpc_ws(ws, {"type": "mcp", "data": rpc("tools/call", call)})
            assert ok["data"]["result"]["is_error"] is False
            alive = await rpc_ws(ws, simulate())
            assert alive["data"]["observation"]["step"] == 2

        # The /mcp socket: one session per socket, started by its first call.
        mcp_url = ws_url(url).removesuffix("/ws") + "/mcp"
        async with websockets.connect(mcp_url) as ws:
            assert (await rpc_ws(ws, "{nope"))["error"]["code"] == -32700
            listed = await rpc_ws(ws, rpc("tools/list"))
            assert listed["result"]["tools"][0]["name"] == "simulate_schedule"
            ok = await rpc_ws(ws, rpc("tools/call", call))
            assert json.loads(ok["result"]["data"])["valid"] is True
            created = await rpc_ws(ws, rpc("openenv/session/create"))
            assert created["result"]["session_id"]
            assert app.state.episodes.active == 1
        # The socket's episode went with it: its slot is free for the next reset.
        async with EnvClient(url, reset_timeout=15) as env:
            assert not (await env.reset(split="eval", index=0)).done


async def test_every_route_but_health_needs_the_token(small: Bundle) -> None:
    with serve(build_app(small, token=TOKEN)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            routes = [
                ("GET", "/schema", None),
                ("GET", "/metadata", None),
                ("POST", "/reset", {}),
                ("POST", "/step", {"action": {"type": "list_tools"}, "episode_id": "x"}),
                ("GET", "/state", None),
                ("POST", "/mcp", rpc("tools/list")),
            ]
            right = {"Authorization": f"Bearer {TOKEN}"}
            for method, path, body in routes:
                for headers in ({}, {"Authorization": "Bearer nope"}):
                    refused = await http.request(method, path, json=body, headers=headers)
                    assert refused.status_code == 401, (path, headers)
                allowed = await http.request(method, path, json=body, headers=right)
                assert allowed.status_code != 401, path
        async with websockets.connect(ws_url(url).removesuffix("/ws") + "/mcp") as ws:
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1008


async def test_schema_metadata_and_version(small: Bundle) -> None:
    with serve(build_app(small)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            schema = (await http.get("/schema")).json()
            assert set(schema) == {"action", "observation", "state"}
            assert "call_tool" in json.dumps(schema["action"])
            meta = (await http.get("/metadata")).json()
            assert meta["name"] == small.name and meta["version"] == small.manifest.version
            assert meta["description"] == small.manifest.description
            assert meta["readme_content"] == (GRIDSIM / "README.md").read_text()
            info = (await http.get("/openapi.json")).json()["info"]
            assert info["version"] == small.manifest.version


async def test_sockets_that_play_nothing_are_closed(small: Bundle) -> None:
    with serve(build_app(small, first_reset_timeout=0.3, idle_timeout=0.3)) as url:
        async with websockets.connect(ws_url(url)) as ws:
            # list_tools is no reset: the socket still goes.
            await rpc_ws(ws, {"type": "step", "data": {"type": "list_tools"}})
            with pytest.raises(websockets.ConnectionClosed):
                async with asyncio.timeout(10):
                    await ws.recv()
            assert ws.close_code == 1008 and "no reset" in (ws.close_reason or "")
        async with websockets.connect(ws_url(url)) as ws:
            await rpc_ws(ws, {"type": "reset", "data": {"split": "eval", "index": 0}})
            submit = {"type": "call_tool", "tool_name": "submit_schedule"}
            await rpc_ws(ws, {"type": "step", "data": {**submit, "arguments": {"schedule": IDLE}}})
            with pytest.raises(websockets.ConnectionClosed):
                async with asyncio.timeout(10):
                    await ws.recv()
            assert ws.close_code == 1008 and "idle_timeout" in (ws.close_reason or "")
        # The /mcp socket: idle with no episode (listing tools starts none) for idle_timeout.
        async with websockets.connect(ws_url(url).removesuffix("/ws") + "/mcp") as ws:
            await rpc_ws(ws, {"jsonrpc": "2.0", "method": "tools/list", "id": 1})
            with pytest.raises(websockets.ConnectionClosed):
                async with asyncio.timeout(10):
                    await ws.recv()
            assert ws.close_code == 1008 and "idle_timeout" in (ws.close_reason or "")
