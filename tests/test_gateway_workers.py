"""``corral gateway --workers 2``: two worker processes behind one address, each owning the
sessions it created, every request reaching its session's owner.

Real parts: ``corral gateway --workers 2 --journal DIR`` as a child process (the parent binds
the port and supervises two worker processes that accept on it and forward to each other
over Unix sockets), httpx clients that open a fresh connection for every request (so that a
request lands on whichever worker accepts it, the owner or not), the gateway's admin API and
its journal. The engine is the scripted TEST engine (tests/scripted_engine.py, SGLang's API on
127.0.0.1 in this process), which answers each prompt with tokens chosen by the prompt, and
keeps every request so that samples are checked token for token. The killed worker is
SIGKILLed from here, as an operator's ``kill -9`` would; waiting for it to be back polls
``/health`` (a child's readiness, as ``corral.processes`` does), never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from corral.gateway.launch import GatewayLaunch
from corral.gateway.workers import (
    JOURNAL_MARKER,
    merge_pages,
    owner_of,
    route,
    worker_prefix,
)
from corral.processes import ChildServer, child_server
from tests.gateway_stack import check_exact_calls
from tests.scripted_engine import Received, ScriptedEngine
from tests.servers import raw_connect, serve

ADMIN = "workers-test-admin"
ADMIN_VAR = "CORRAL_WORKERS_TEST_ADMIN"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
SESSIONS = 16
TURNS = 4
LOGPROB = -0.25

pytestmark = pytest.mark.timeout(120)


@dataclass
class Gateway:
    child: ChildServer
    engine: ScriptedEngine
    tokenizer: Any
    journal: Path
    log: Path

    @property
    def url(self) -> str:
        return self.child.url


def fresh(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """One request over a connection of its own (httpx's module functions open a new one)."""
    kwargs.setdefault("timeout", 30)
    return httpx.request(method, url, **kwargs)


def replying(tokenizer: Any) -> Callable[[list[int]], list[int]]:
    end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def reply(input_ids: list[int]) -> list[int]:
        word = ["north", "south", "east", "west"][zlib.crc32(str(input_ids).encode()) % 4]
        return [*tokenizer(f"go {word}", add_special_tokens=False).input_ids, end]

    return reply


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    engine = ScriptedEngine(
        eos_token_ids=[int(tokenizer.convert_tokens_to_ids("<|im_end|>"))],
        default=replying(tokenizer),
        logprob=LOGPROB,
        chunk_tokens=1,
    )
    folder = tmp_path_factory.mktemp("workers")
    journal = folder / "journal"
    log = folder / "gateway.log"
    with serve(engine.app) as engine_url:
        launch = GatewayLaunch(
            engine_url=engine_url,
            model=tiny_model_dir,
            admin_token_var=ADMIN_VAR,
            served_model_name="tiny",
            journal_dir=journal,
            workers=2,
        )
        with child_server(
            launch.to_argv(), log=log, env={ADMIN_VAR: ADMIN}, ready_timeout=120
        ) as child:
            yield Gateway(child, engine, tokenizer, journal, log)


def open_sessions(url: str, n: int, *, start: int = 0) -> list[dict[str, Any]]:
    """At least ``n`` sessions, each over a fresh connection, and more until both workers
    made some (which worker accepts a connection is the kernel's and the workers' timing: a
    short run of them may all land on one), at most 200 more."""
    made: list[dict[str, Any]] = []
    while len(made) < n or {owner_of(s["id"]) for s in made} != {0, 1}:
        assert len(made) < n + 200, "every session landed on one worker"
        k = start + len(made)
        r = fresh("POST", f"{url}/sessions", headers=AUTH, json={"metadata": {"k": k}})
        assert r.status_code == 201, r.text
        made.append(
            {
                **r.json(),
                "metadata_k": k,
                "messages": [{"role": "user", "content": f"task {k:03d} here"}],
            }
        )
    return made


def requests_of(engine: ScriptedEngine, tokenizer: Any, marker: str) -> list[Received]:
    """The engine requests of one session (its prompts hold ``marker``), first turn first."""
    mine = [r for r in engine.requests if marker in tokenizer.decode(r.input_ids)]
    return sorted(mine, key=lambda r: len(r.input_ids))


def streamed_text(body: str) -> str:
    text = ""
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


def worker_pids(parent: int) -> list[int]:
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return [int(pid) for pid in children]


# -- the routing logic, as plain functions --------------------------------------------------------


def test_owner_marks_are_read_back_exactly() -> None:
    assert [owner_of(worker_prefix(k) + "abc") for k in (0, 1, 7, 123)] == [0, 1, 7, 123]
    for unmarked in ("", "0a1b2c", "w.1", "w01.x", "wx.", "W1.x", "corral-admin-probe", "w1"):
        assert owner_of(unmarked) is None
    key = [(b"authorization", b"Bearer w1.secret")]
    assert route("POST", "/v1/chat/completions", key, me=0, workers=2).worker == 1
    assert route("POST", "/v1/messages", [(b"x-api-key", b"w1.k")], me=0, workers=2).worker == 1
    # Two Authorization headers: the first counts, as in the app behind the router.
    twice = [(b"authorization", b"Bearer w1.k"), (b"authorization", b"Bearer w0.k")]
    assert route("POST", "/v1/chat/completions", twice, me=0, workers=2).worker == 1
    assert route("GET", "/sessions/w1.ab/samples", [], me=1, workers=2).where == "here"
    assert route("GET", "/sessions/w5.ab", [], me=0, workers=2).where == "here"  # no worker 5
    assert route("POST", "/sessions", [], me=0, workers=2).where == "here"
    assert route("GET", "/sessions", [], me=0, workers=2).where == "list"


def test_pages_merge_in_worker_order() -> None:
    def page(ids: list[str], total: int, more: bool) -> dict[str, Any]:
        return {
            "sessions": [{"id": i} for i in ids],
            "total": total,
            "next": ids[-1] if more else None,
        }

    pages = [page(["w0.a", "w0.b"], 2, False), page(["w1.a", "w1.b", "w1.c"], 3, False)]
    merged = merge_pages(pages, first=0, limit=3)
    assert [s["id"] for s in merged["sessions"]] == ["w0.a", "w0.b", "w1.a"]
    assert merged["total"] == 5 and merged["next"] == "w1.a"
    last = merge_pages(
        [page(["w0.a"], 2, True), page(["w1.b", "w1.c"], 3, False)], first=1, limit=3
    )
    assert [s["id"] for s in last["sessions"]] == ["w1.b", "w1.c"] and last["next"] is None


# -- the real gateway ------------------------------------------------------------------------------


def test_sessions_land_on_both_workers_and_record_exactly(gateway: Gateway) -> None:
    sessions = open_sessions(gateway.url, SESSIONS)
    owners = {owner_of(s["id"]) for s in sessions}
    assert owners == {0, 1}, [s["id"] for s in sessions]
    assert all(owner_of(s["api_key"]) == owner_of(s["id"]) for s in sessions)
    forwarded = {"plain": 0, "stream": 0}
    for turn in range(TURNS):
        for s in sessions:
            stream = turn % 2 == 1
            # Turns alternate between the session's own URL and the by-key route.
            url = s["base_url"] if turn < 2 else f"{gateway.url}/v1"
            r = fresh(
                "POST",
                f"{url}/chat/completions",
                headers={"Authorization": f"Bearer {s['api_key']}"},
                json={"model": "tiny", "messages": s["messages"], "stream": stream},
            )
            assert r.status_code == 200, r.text
            if stream:
                assert r.headers["content-type"].startswith("text/event-stream")
                text = streamed_text(r.text)
            else:
                text = r.json()["choices"][0]["message"]["content"]
            assert text.startswith("go ")
            if "x-corral-forwarded-by" in r.headers:
                assert int(r.headers["x-corral-forwarded-by"]) != owner_of(s["id"])
                forwarded["stream" if stream else "plain"] += 1
            s["messages"] += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"now step {turn + 1}"},
            ]
    # Fresh connections land on either worker: some turns reached the other one first.
    assert forwarded["plain"] > 0 and forwarded["stream"] > 0, forwarded
    for s in sessions:
        k = s["metadata_k"]
        r = fresh("GET", f"{gateway.url}/sessions/{s['id']}/samples", headers=AUTH)
        assert r.status_code == 200, r.text
        samples = r.json()
        assert len(samples) == 1, samples
        calls = requests_of(gateway.engine, gateway.tokenizer, f"task {k:03d} here")
        check_exact_calls(samples[0], calls, TURNS)
        assert samples[0]["metadata"]["k"] == k


def test_the_session_list_holds_every_workers_sessions(gateway: Gateway) -> None:
    made = {s["id"] for s in open_sessions(gateway.url, 5, start=500)}
    seen: list[str] = []
    after = None
    while True:
        query = {"limit": 3, **({"after": after} if after else {})}
        r = fresh("GET", f"{gateway.url}/sessions", headers=AUTH, params=query)
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["sessions"]) <= 3
        seen += [s["id"] for s in page["sessions"]]
        total = page["total"]
        after = page["next"]
        if after is None:
            break
    assert len(seen) == len(set(seen)) == total
    assert made <= set(seen)
    assert {owner_of(i) for i in seen} == {0, 1}
    # A worker's own refusal comes back as it is.
    assert fresh("GET", f"{gateway.url}/sessions").status_code == 401
    assert (
        fresh("GET", f"{gateway.url}/sessions", headers=AUTH, params={"limit": 0}).status_code
        == 400
    )


def test_an_unknown_session_is_404_whichever_worker_takes_it(gateway: Gateway) -> None:
    for session_id in ("w0.000000000000000000000000", "w1.000000000000000000000000", "nope"):
        for _ in range(4):  # fresh connections: either worker takes each
            r = fresh("GET", f"{gateway.url}/sessions/{session_id}/samples", headers=AUTH)
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "session_not_found"
    for key in ("w0.bogus", "w1.bogus"):
        r = fresh(
            "POST",
            f"{gateway.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 401, r.text


def test_metrics_carry_every_worker(gateway: Gateway) -> None:
    text = fresh("GET", f"{gateway.url}/metrics").text
    assert 'corral_gateway_worker_up{worker="0"} 1.0' in text
    assert 'corral_gateway_worker_up{worker="1"} 1.0' in text
    assert 'corral_gateway_sessions{worker="0"}' in text
    assert 'corral_gateway_sessions{worker="1"}' in text


def test_a_journal_written_by_other_workers_is_refused(
    gateway: Gateway, tiny_model_dir: Path
) -> None:
    assert json.loads((gateway.journal / JOURNAL_MARKER).read_text()) == {"workers": 2}
    out = subprocess.run(
        [
            *(sys.executable, "-m", "corral.cli", "gateway", "--engine-url", "http://127.0.0.1:9"),
            *("--model", str(tiny_model_dir), "--journal", str(gateway.journal), "--workers", "3"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "written by a gateway with --workers 2" in out.stderr


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)  # polling another process's state, not synchronising threads


def test_a_client_gone_before_a_forwarded_answer_records_nothing(gateway: Gateway) -> None:
    """A client that hangs up while the engine works: its turn is aborted and not recorded,
    whichever worker took the connection (a relay must pass the hang-up on to the owner)."""
    sessions = open_sessions(gateway.url, 6, start=700)
    port = int(gateway.url.rsplit(":", 1)[1])
    aborts = len(gateway.engine.aborts)
    gateway.engine.delay_s = 1.0  # per token: the answer takes seconds
    try:
        for s in sessions:
            body = json.dumps({"model": "tiny", "messages": s["messages"]}).encode()
            path = s["base_url"].split(str(port), 1)[1] + "/chat/completions"
            head = (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {s['api_key']}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            marker = f"task {s['metadata_k']:03d} here"
            with raw_connect(port, 10) as sock:
                sock.sendall(head.encode() + body)
                wait_for(
                    "the engine got the turn",
                    lambda m=marker: bool(requests_of(gateway.engine, gateway.tokenizer, m)),
                    10,
                )
            # Closed here: before any answer.
        wait_for(
            "every turn aborted at the engine",
            lambda: len(gateway.engine.aborts) >= aborts + len(sessions),
            30,
        )
    finally:
        gateway.engine.delay_s = 0.0
    for s in sessions:
        r = fresh("GET", f"{gateway.url}/sessions/{s['id']}/samples", headers=AUTH)
        assert r.status_code == 200 and r.json() == [], (s["id"], r.text)


def test_a_killed_worker_is_restarted_with_its_sessions(gateway: Gateway) -> None:
    sessions = open_sessions(gateway.url, 1, start=800)
    victim = next(s for s in sessions if owner_of(s["id"]) == 1)
    r = fresh(
        "POST",
        f"{victim['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {victim['api_key']}"},
        json={"model": "tiny", "messages": victim["messages"]},
    )
    assert r.status_code == 200, r.text
    before = fresh("GET", f"{gateway.url}/sessions/{victim['id']}/samples", headers=AUTH).json()
    pids = worker_pids(gateway.child.process.pid)
    assert len(pids) == 2
    # Worker 1 is the one whose log line names its pid.
    log = gateway.log.read_text()
    worker1 = next(p for p in pids if f"gateway worker 1 started (pid {p})" in log)
    os.kill(worker1, signal.SIGKILL)
    health = fresh("GET", f"{gateway.url}/health")
    down_seen = health.status_code == 503
    deadline = time.monotonic() + 90
    while health.status_code != 200:
        assert time.monotonic() < deadline, health.text
        if health.status_code == 503 and not health.json()["workers"][1]["up"]:
            down_seen = True
            r = fresh("GET", f"{gateway.url}/sessions/{victim['id']}/samples", headers=AUTH)
            # Unless the restarted worker took over in between: a 503 naming the worker.
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "worker_unavailable"
        time.sleep(0.2)  # polling a restarting child's readiness, not synchronising threads
        health = fresh("GET", f"{gateway.url}/health")
    assert down_seen
    assert health.json()["workers"] == [
        {"worker": 0, "up": True, "status": 200},
        {"worker": 1, "up": True, "status": 200},
    ]
    assert worker1 not in worker_pids(gateway.child.process.pid)
    assert f"gateway worker 1 (pid {worker1}) exited with status -9" in gateway.log.read_text()
    # Its journal gave the restarted worker its sessions back, token for token.
    after = fresh("GET", f"{gateway.url}/sessions/{victim['id']}/samples", headers=AUTH)
    assert after.status_code == 200, after.text
    assert after.json() == before
