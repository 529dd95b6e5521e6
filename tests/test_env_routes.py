"""The env server's routes against hostile clients, over real sockets and HTTP on 127.0.0.1:
JSON that Python will not parse, bodies past the cap, ids of strange types, sockets that
linger after their episode or send everything but a reset, resets abandoned while they wait
for room, and the OpenAPI routes behind the token."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from corral.envs.bundle import load_bundle
from corral.envs.client import ws_url
from corral.envs.server import build_app
from tests.servers import serve

GRIDSIM = Path(__file__).resolve().parent.parent / "bundles" / "gridsim"
TOKEN = "s3cret-token"
IDLE = [0] * 24
# One past what Python 3.11's int() reads from text: json.loads raises a plain ValueError.
HUGE_INT = "1" + "0" * 5000


def mcp_url(url: str) -> str:
    return ws_url(url).removesuffix("/ws") + "/mcp"


async def exchange(ws: Any, message: Any) -> dict[str, Any]:
    """Send one frame (a dict as JSON, a str as is) and read the reply."""
    await ws.send(message if isinstance(message, str) else json.dumps(message))
    return dict(json.loads(await ws.recv()))


def rpc(method: str, params: dict[str, Any] | None = None, rid: Any = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params or {}, "id": rid}


SIMULATE = {
    "type": "step",
    "data": {
        "type": "call_tool",
        "tool_name": "simulate_schedule",
        "arguments": {"schedule": IDLE},
    },
}


async def test_integers_past_pythons_digit_limit_are_bad_json_everywhere() -> None:
    app = build_app(load_bundle(GRIDSIM))
    with serve(app) as url:
        async with websockets.connect(ws_url(url)) as ws:
            await exchange(ws, {"type": "reset", "data": {"split": "eval", "index": 0}})
            reply = await exchange(ws, '{"type": "state", "request_id": ' + HUGE_INT + "}")
            assert reply["type"] == "error" and reply["data"]["code"] == "INVALID_JSON"
            assert "4300" in reply["data"]["message"]
            # The socket and its episode are untouched.
            alive = await exchange(ws, SIMULATE)
            assert alive["data"]["observation"]["step"] == 1
        async with websockets.connect(mcp_url(url)) as ws:
            first = await exchange(ws, rpc("tools/call", {"name": "simulate_schedule"}))
            assert "result" in first or first["error"]["code"] != -32700
            reply = await exchange(
                ws, '{"jsonrpc": "2.0", "method": "tools/list", "id": ' + HUGE_INT + "}"
            )
            assert reply["error"]["code"] == -32700 and reply["id"] is None
            listed = await exchange(ws, rpc("tools/list"))
            assert listed["result"]["tools"]
        async with httpx.AsyncClient(base_url=url) as http:
            episode = (await http.post("/reset", json={})).json()["observation"]["episode_id"]
            posted = await http.post("/mcp", content='{"jsonrpc": "2.0", "id": ' + HUGE_INT + "}")
            assert posted.status_code == 200 and posted.json()["error"]["code"] == -32700
            for path, body in [
                ("/reset", '{"seed": ' + HUGE_INT + "}"),
                ("/step", '{"action": {"type": "list_tools"}, "episode_id": ' + HUGE_INT + "}"),
            ]:
                refused = await http.post(path, content=body)
                assert refused.status_code == 400, (path, refused.text[:200])
                assert refused.json()["detail"]["code"] == "INVALID_JSON"
            state = await http.get("/state", params={"episode_id": episode})
            assert state.status_code == 200 and state.json()["step_count"] == 0


async def test_bodies_past_the_cap_are_refused_before_they_are_read_whole() -> None:
    cap = 2048
    app = build_app(load_bundle(GRIDSIM), max_body_bytes=cap)
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            episode = (await http.post("/reset", json={})).json()["observation"]["episode_id"]
            big = json.dumps({"action": {"type": "list_tools"}, "episode_id": "x" * 4 * cap})

            async def chunked() -> AsyncIterator[bytes]:
                # No content-length: the server must count as it reads.
                for start in range(0, len(big), 512):
                    yield big[start : start + 512].encode()

            for path in ("/step", "/reset", "/mcp"):
                for content in (big, chunked()):
                    refused = await http.post(path, content=content)
                    assert refused.status_code == 413, (path, refused.text[:200])
                    assert str(cap) in refused.text and "max_body_bytes" in refused.text
                    assert len(refused.text) < 1000
                    if path == "/mcp":
                        assert refused.json()["error"]["code"] == -32600
                    else:
                        assert refused.json()["detail"]["reason"] == "body_too_large"
            # Under the cap, an episode id longer than a reset can name is refused; a long
            # unknown one is quoted cut short.
            long_id = await http.post(
                "/step", json={"action": {"type": "list_tools"}, "episode_id": "x" * 256}
            )
            assert long_id.status_code == 422
            unknown = await http.get("/state", params={"episode_id": "y" * 3000})
            assert unknown.status_code == 404 and len(unknown.text) < 400
            assert "3000 characters" in unknown.json()["detail"]["message"]
            state = await http.get("/state", params={"episode_id": episode})
            assert state.status_code == 200


async def test_a_socket_whose_episode_is_reaped_is_closed() -> None:
    app = build_app(load_bundle(GRIDSIM), idle_timeout=0.3)
    with serve(app) as url:
        async with websockets.connect(ws_url(url)) as ws:
            await exchange(ws, {"type": "reset", "data": {"split": "eval", "index": 0}})
            with pytest.raises(websockets.ConnectionClosed):
                async with asyncio.timeout(10):
                    await ws.recv()
            assert ws.close_code == 1008
            assert "closed after 0.3 s idle" in (ws.close_reason or ""), ws.close_reason
        async with websockets.connect(mcp_url(url)) as ws:
            created = await exchange(ws, rpc("openenv/session/create"))
            assert created["result"]["session_id"]
            with pytest.raises(websockets.ConnectionClosed):
                async with asyncio.timeout(10):
                    await ws.recv()
            assert ws.close_code == 1008 and "idle" in (ws.close_reason or "")
        assert app.state.episodes.active == 0


async def test_first_reset_timeout_is_a_deadline_from_connecting() -> None:
    """Frames that start no episode (listings, garbage) do not keep the socket open."""
    app = build_app(load_bundle(GRIDSIM), first_reset_timeout=1.0, idle_timeout=1.0)
    with serve(app) as url:
        for target, frames in [
            (ws_url(url), [{"type": "step", "data": {"type": "list_tools"}}, "{garbage"]),
            (mcp_url(url), [rpc("tools/list"), "{garbage"]),
        ]:
            async with websockets.connect(target) as ws:
                opened = time.monotonic()
                with pytest.raises(websockets.ConnectionClosed):
                    async with asyncio.timeout(10):
                        while True:
                            for frame in frames:
                                await exchange(ws, frame)
                assert ws.close_code == 1008, target
                assert time.monotonic() - opened < 5, target
                assert any(w in (ws.close_reason or "") for w in ("no reset", "idle_timeout"))


async def test_an_abandoned_http_reset_frees_its_slot() -> None:
    app = build_app(load_bundle(GRIDSIM), max_concurrent_envs=1, reset_timeout=5)
    manager = app.state.episodes
    waiting = threading.Event()  # set on the server's thread
    manager.on_capacity_wait = waiting.set
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            held = (await http.post("/reset", json={})).json()["observation"]["episode_id"]

            async def give_up() -> None:
                async with httpx.AsyncClient(base_url=url) as other:
                    await other.post("/reset", json={})

            abandoned = asyncio.create_task(give_up())
            assert await asyncio.to_thread(waiting.wait, 10), "the second reset never waited"
            abandoned.cancel()
            with pytest.raises(asyncio.CancelledError):
                await abandoned
            closed = await http.post(
                "/mcp", json=rpc("openenv/session/close", {"session_id": held})
            )
            assert closed.json()["result"]["closed"] is True
            # The abandoned reset made no episode (or closed the one it made): room for this.
            fresh = await http.post("/reset", json={})
            assert fresh.status_code == 200, fresh.text
            assert manager.active == 1


async def test_docs_and_schema_need_the_token_when_one_is_set() -> None:
    with serve(build_app(load_bundle(GRIDSIM), token=TOKEN)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            right = {"Authorization": f"Bearer {TOKEN}"}
            for headers in ({}, {"Authorization": "Bearer nope"}):
                assert (await http.get("/openapi.json", headers=headers)).status_code == 401
            schema = await http.get("/openapi.json", headers=right)
            assert schema.status_code == 200 and "/reset" in schema.json()["paths"]
            assert "/openapi.json" not in schema.json()["paths"]
            for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
                assert (await http.get(page)).status_code == 404, page
                assert (await http.get(page, headers=right)).status_code == 404, page
    with serve(build_app(load_bundle(GRIDSIM))) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            for page in ("/openapi.json", "/docs", "/redoc"):
                assert (await http.get(page)).status_code == 200, page


async def test_ids_are_echoed_as_sent_or_refused() -> None:
    with serve(build_app(load_bundle(GRIDSIM))) as url:
        async with websockets.connect(ws_url(url)) as ws:
            await exchange(ws, {"type": "reset", "data": {"split": "eval", "index": 0}})
            for rid in (True, 1.0, [1]):
                reply = await exchange(ws, {"type": "state", "request_id": rid})
                assert reply["type"] == "error", rid
                assert reply["data"]["code"] == "VALIDATION_ERROR" and "request_id" not in reply
            for rid in (7, "seven"):
                reply = await exchange(ws, {"type": "state", "request_id": rid})
                assert reply["type"] == "state" and reply["request_id"] == rid
        async with httpx.AsyncClient(base_url=url) as http:
            for rid in (True, 2.0):
                reply = (await http.post("/mcp", json=rpc("tools/list", rid=rid))).json()
                assert reply["error"]["code"] == -32600 and reply["id"] is None, rid
            ok = (await http.post("/mcp", json=rpc("tools/list", rid="a"))).json()
            assert ok["id"] == "a" and ok["result"]["tools"]


async def test_session_create_on_a_live_socket_refuses_other_params() -> None:
    with serve(build_app(load_bundle(GRIDSIM))) as url:
        async with websockets.connect(mcp_url(url)) as ws:
            params = {"split": "eval", "index": 0}
            created = await exchange(ws, rpc("openenv/session/create", params))
            session = created["result"]["session_id"]
            same = await exchange(ws, rpc("openenv/session/create", params))
            assert same["result"]["session_id"] == session
            bare = await exchange(ws, rpc("openenv/session/create"))
            assert bare["result"]["session_id"] == session
            for other in (
                {"task_id": "no-such-task"},
                {"split": "eval", "index": 1},
                {"episode_id": "someone-else"},
            ):
                reply = await exchange(ws, rpc("openenv/session/create", other))
                assert reply["error"]["code"] == -32602, (other, reply)
            call = {"name": "simulate_schedule", "arguments": {"schedule": IDLE}}
            ok = await exchange(ws, rpc("tools/call", {**call, "session_id": session}))
            assert ok["result"]["is_error"] is False


async def test_json_rpc_notifications_get_no_response() -> None:
    """A request with no ``id`` is run and never answered (JSON-RPC 2.0), errors included."""
    call = {"name": "simulate_schedule", "arguments": {"schedule": IDLE}}
    with serve(build_app(load_bundle(GRIDSIM))) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            created = (await http.post("/mcp", json=rpc("openenv/session/create"))).json()
            session = created["result"]["session_id"]
            for note in (
                {
                    "jsonrpc": "2.0",
                    "method": "tools/call",
                    "params": {**call, "session_id": session},
                },
                {"jsonrpc": "2.0", "method": "notifications/initialized"},
            ):
                posted = await http.post("/mcp", json=note)
                assert posted.status_code == 202 and posted.content == b"", posted.text
            state = await http.get("/state", params={"episode_id": session})
            assert state.json()["step_count"] == 1  # the notification's call was run
            invalid = (await http.post("/mcp", json={"jsonrpc": "2.0"})).json()
            assert invalid["error"]["code"] == -32600 and invalid["id"] is None
        async with websockets.connect(mcp_url(url)) as ws:
            await ws.send(json.dumps({"jsonrpc": "2.0", "method": "tools/call", "params": call}))
            reply = await exchange(ws, rpc("tools/list", rid="after"))
            assert reply["id"] == "after"  # the notification sent no frame of its own
        async with websockets.connect(ws_url(url)) as ws:
            await exchange(ws, {"type": "reset", "data": {"split": "eval", "index": 0}})
            note = {"jsonrpc": "2.0", "method": "tools/call", "params": call}
            await ws.send(json.dumps({"type": "mcp", "data": note}))
            state = await exchange(ws, {"type": "state", "request_id": "s"})
            assert state["type"] == "state" and state["request_id"] == "s"
            assert state["data"]["step_count"] == 1
