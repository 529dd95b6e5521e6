"""Engines that fail behind one gateway (``--engine-url A,B``): fail-over, hang detection,
weights checked on revival.

The engines are the scripted test engine (tests/scripted_engine.py: SGLang's API, no model),
a stand-in for SGLang or corral's engine: the end-to-end tests run each one as a real child
process on 127.0.0.1, so that it can be SIGKILLed, SIGSTOPped and SIGCONTed. Each answers a
prompt with a reply chosen by a hash of its ids (so every engine, and a retry, answers a
prompt the same way and samples can be checked token-exact) and with its own logprob (so a
sample tells which engine made each turn). The gateway is corral's, built by
``create_gateway`` (the monitor, the retries and their wiring are what is tested).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from corral.engines.affinity import SessionAffineEngines, rendezvous_order
from corral.engines.health import EngineState, HealthMonitor
from corral.engines.protocol import GenerateRequest, ModelInfo, SamplingParams
from corral.engines.sglang import SGLangClient
from corral.gateway.server import create_gateway, engine_monitor, model_context_length
from corral.gateway.settings import GatewaySettings
from tests.gateway_stack import ADMIN, AUTH
from tests.scripted_engine import ScriptedEngine
from tests.servers import free_port, serve

REPLIES = 64
LOGPROBS = (-0.5, -0.25)  # engine 0's, engine 1's

# The child: a scripted engine answering from a table of replies (the parent tokenized
# them, so the child needs no tokenizer), chunk by chunk, slowly enough to be caught mid-way.
CHILD = """
import json, sys, zlib
import uvicorn
from tests.scripted_engine import ScriptedEngine
table = json.load(open(sys.argv[1]))
eos, logprob, port = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
def reply(ids):
    return table[zlib.crc32(json.dumps(ids).encode()) % len(table)]
engine = ScriptedEngine(
    eos_token_ids=[eos], chunk_tokens=1, delay_s=0.02, logprob=logprob, default=reply
)
uvicorn.run(engine.app, host="127.0.0.1", port=port, log_level="warning")
"""


def wait_until(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    """Poll ``check`` until true; the seconds it took. Fails after ``timeout_s``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)
    return time.monotonic() - start


@dataclass
class Child:
    url: str
    process: subprocess.Popen[bytes]


@dataclass
class Replies:
    table: list[list[int]]
    eos: int

    def __call__(self, ids: list[int]) -> list[int]:
        return self.table[zlib.crc32(json.dumps(ids).encode()) % len(self.table)]


@pytest.fixture(scope="module")
def replies(tiny_model_dir: Path) -> Replies:
    tokenizer: Any = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    table = []
    for n in range(REPLIES):
        text = f"Answer number {n} is ready."
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        assert tokenizer.decode(ids) == text
        table.append([*ids, eos])
    return Replies(table, eos)


@contextmanager
def child_engines(replies: Replies, folder: Path) -> Iterator[list[Child]]:
    """Two scripted engines as child processes, killed at the end (SIGCONT first: one may be
    stopped)."""
    folder.mkdir(parents=True, exist_ok=True)
    table = folder / "replies.json"
    table.write_text(json.dumps(replies.table))
    children: list[Child] = []
    try:
        for i, logprob in enumerate(LOGPROBS):
            port = free_port("127.0.0.1")
            argv = [sys.executable, "-c", CHILD, str(table), str(replies.eos), str(logprob)]
            with (folder / f"engine{i}.log").open("ab") as log:
                process = subprocess.Popen(
                    [*argv, str(port)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=str(Path(__file__).resolve().parent.parent),
                    env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
                )
            children.append(Child(f"http://127.0.0.1:{port}", process))
        for child in children:
            wait_until(f"{child.url} answers", lambda c=child: _healthy(c), 60)
        yield children
    finally:
        for child in children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGCONT)
                child.process.kill()
            child.process.wait(timeout=10)


def _healthy(child: Child) -> bool:
    assert child.process.poll() is None, f"engine {child.url} exited"
    try:
        return httpx.get(f"{child.url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def gateway(model: Path, urls: list[str]) -> Iterator[tuple[str, HealthMonitor]]:
    settings = GatewaySettings(
        model_name="tiny",
        max_context_tokens=model_context_length(model),
        admin_token=ADMIN,
        engine_timeout_s=30,
    )
    app = create_gateway(",".join(urls), model, settings=settings)
    monitor = app.state.engine_monitor
    assert isinstance(monitor, HealthMonitor)
    with serve(app) as url:
        wait_until("the monitor's first round", lambda: monitor.rounds > 0, 10)
        yield url, monitor


class Player:
    """One session played turn by turn over plain HTTP: ``turn()`` sends the conversation so
    far, streamed or not, and keeps the answer. A streamed turn that broke after some content
    had arrived is counted in ``broken_midway`` and played again (the client saw tokens: that
    failure is the client's to handle); any other failure fails the test."""

    def __init__(self, url: str) -> None:
        r = httpx.post(f"{url}/sessions", headers=AUTH, json={})
        assert r.status_code == 201, r.text
        session = r.json()
        self.id = str(session["id"])
        self.base = session["base_url"]
        self.headers = {"Authorization": f"Bearer {session['api_key']}"}
        self.messages: list[dict[str, str]] = []
        self.broken_midway = 0
        self.http = httpx.Client(timeout=60, trust_env=False)

    def turn(self, k: int, *, stream: bool) -> None:
        self.messages.append({"role": "user", "content": f"Question {k} of session {self.id}?"})
        for _ in range(3):
            text = self._stream() if stream else self._complete()
            if text is not None:
                self.messages.append({"role": "assistant", "content": text})
                return
        raise AssertionError(f"session {self.id}: turn {k} broke mid-stream three times")

    def _body(self, stream: bool) -> dict[str, Any]:
        return {"model": "tiny", "messages": self.messages, "temperature": 0, "stream": stream}

    def _complete(self) -> str:
        r = self.http.post(
            f"{self.base}/chat/completions", headers=self.headers, json=self._body(False)
        )
        assert r.status_code == 200, f"session {self.id}: a non-streamed turn failed: {r.text}"
        return str(r.json()["choices"][0]["message"]["content"])

    def _stream(self) -> str | None:
        text, content_seen = "", False
        url = f"{self.base}/chat/completions"
        try:
            with self.http.stream("POST", url, headers=self.headers, json=self._body(True)) as r:
                if r.status_code != 200:
                    r.read()
                    raise AssertionError(
                        f"session {self.id}: a streamed turn failed before streaming: {r.text}"
                    )
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        assert content_seen, f"session {self.id}: error before output: {chunk}"
                        self.broken_midway += 1
                        return None
                    for choice in chunk.get("choices", []):
                        piece = choice.get("delta", {}).get("content") or ""
                        content_seen = content_seen or bool(piece)
                        text += piece
        except httpx.HTTPError as exc:
            assert content_seen, f"session {self.id}: the stream broke before output: {exc}"
            self.broken_midway += 1
            return None
        return text

    def close(self) -> None:
        self.http.close()


def check_exact(url: str, session_id: str, turns: int, replies: Replies) -> list[float]:
    """The session's one sample: each run of engine tokens is exactly the reply to the
    tokens before it, with one engine's logprob; returns the logprob of each turn."""
    r = httpx.get(f"{url}/sessions/{session_id}/samples", headers=AUTH)
    assert r.status_code == 200, r.text
    (sample,) = r.json()
    tokens, mask, lps = sample["tokens"], sample["loss_mask"], sample["rollout_log_probs"]
    prompt = len(tokens) - sample["response_length"]
    runs: list[tuple[int, int]] = []
    for k, m in enumerate(mask):
        if m and (not runs or runs[-1][1] != prompt + k):
            runs.append((prompt + k, prompt + k + 1))
        elif m:
            runs[-1] = (runs[-1][0], prompt + k + 1)
    assert len(runs) == turns == sample["metadata"]["num_turns"], (runs, sample["metadata"])
    used = []
    for start, end in runs:
        assert tokens[start:end] == replies(tokens[:start])
        turn_lps = set(lps[start - prompt : end - prompt])
        assert len(turn_lps) == 1 and turn_lps <= set(LOGPROBS), turn_lps
        used.append(turn_lps.pop())
    assert all(lp == 0 for m, lp in zip(mask, lps, strict=True) if not m)
    return used


# --- end to end ------------------------------------------------------------------------------


def test_an_engine_killed_mid_load_costs_no_turn_that_had_not_started_streaming(
    tiny_model_dir: Path, replies: Replies, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """32 sessions of 4 turns (plain, streamed, plain, streamed); one engine SIGKILLed once
    a quarter of the turns are done. Turns in flight there that had sent no content yet are
    retried on the other engine; streams that had are the only failures a client may see
    (and it plays the turn again). Every session ends with an exact sample."""
    caplog.set_level(logging.INFO, "corral.engines.affinity")
    sessions, turns = 32, 4
    with (
        child_engines(replies, tmp_path) as children,
        gateway(tiny_model_dir, [c.url for c in children]) as (url, monitor),
    ):
        done = threading.Semaphore(0)
        players = [Player(url) for _ in range(sessions)]
        by_engine = [
            sum(rendezvous_order(p.id, monitor.names)[0] == i for p in players) for i in (0, 1)
        ]
        assert min(by_engine) > 0, by_engine

        def play(player: Player) -> None:
            for k in range(turns):
                player.turn(k, stream=k % 2 == 1)
                done.release()

        with ThreadPoolExecutor(sessions) as pool:
            futures = [pool.submit(play, p) for p in players]
            for _ in range(sessions):  # a quarter of the turns played, the rest under way
                assert done.acquire(timeout=60)
            children[0].process.kill()
            for future in futures:
                future.result(timeout=120)  # raises what a client saw
        used = [check_exact(url, p.id, turns, replies) for p in players]
        wait_until("the killed engine marked down", lambda: monitor.state(0) == "down", 10)
        for p in players:
            p.close()
    # Both engines served before the kill; only the survivor after it, so some moved.
    assert {lp for u in used for lp in u} == set(LOGPROBS)
    assert all(u[-1] == LOGPROBS[1] for u in used)
    moved = sum(u[0] == LOGPROBS[0] for u in used)
    assert moved > 0
    gone = "leaves the engine at " + children[0].url
    left = [r for r in caplog.records if gone in r.getMessage()]
    assert left, "no request was retried on the other engine"
    broken = sum(p.broken_midway for p in players)
    print(f"{moved} sessions moved, {len(left)} requests retried, {broken} streams broke midway")


def test_a_stopped_engine_is_marked_down_within_10_s_and_comes_back(
    tiny_model_dir: Path, replies: Replies, tmp_path: Path
) -> None:
    with (
        child_engines(replies, tmp_path) as children,
        gateway(tiny_model_dir, [c.url for c in children]) as (url, monitor),
    ):
        names = monitor.names
        players: list[Player] = []
        while len(players) < 2 or {rendezvous_order(p.id, names)[0] for p in players} != {0, 1}:
            players.append(Player(url))
        on_0 = next(p for p in players if rendezvous_order(p.id, names)[0] == 0)
        on_1 = next(p for p in players if rendezvous_order(p.id, names)[0] == 1)
        on_0.turn(0, stream=False)
        assert monitor.state(0) == EngineState.UP

        stopped = time.monotonic()
        children[0].process.send_signal(signal.SIGSTOP)
        # A turn sent to the hung engine: given up when the engine is marked down, then
        # answered by the other; the client sees no error.
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(on_0.turn, 1, stream=True)
            wait_until("the stopped engine marked down", lambda: monitor.state(0) == "down", 10)
            detected = time.monotonic() - stopped
            waiting.result(timeout=15)
        print(f"SIGSTOPped engine marked down after {detected:.2f} s")
        assert detected < 10
        on_0.turn(2, stream=False)  # goes straight to the other engine now
        on_1.turn(0, stream=True)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200
        # The gateway's /health says which engine is down and why.
        assert [e["state"] for e in health.json()["engines"]] == ["down", "up"]

        children[0].process.send_signal(signal.SIGCONT)
        wait_until("the resumed engine back up", lambda: monitor.state(0) == "up", 10)
        on_0.turn(3, stream=True)  # back on its first choice
        assert check_exact(url, on_0.id, 4, replies) == [
            LOGPROBS[0],
            *[LOGPROBS[1]] * 2,
            LOGPROBS[0],
        ]
        assert check_exact(url, on_1.id, 1, replies) == [LOGPROBS[1]]
        for p in players:
            p.close()


# --- weights on revival ----------------------------------------------------------------------


@contextmanager
def two_scripted(**kwargs: Any) -> Iterator[tuple[list[ScriptedEngine], list[str]]]:
    engines = [ScriptedEngine(default=[5, 6, 7], **kwargs) for _ in range(2)]
    with ExitStack() as stack:
        urls = [stack.enter_context(serve(e.app)) for e in engines]
        yield engines, urls


async def _until(what: str, check: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


def _request(key: str) -> GenerateRequest:
    return GenerateRequest(
        input_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_new_tokens=8),
        return_logprob=True,
        rid=f"rid-{key}",
        routing_key=key,
    )


def _key_ranking_first(names: list[str], index: int) -> str:
    return next(k for n in range(100) if rendezvous_order(k := f"s{n}", names)[0] == index)


async def test_a_revived_engine_on_stale_weights_is_held_out_until_current() -> None:
    """Without a way to bring it current (no ``catch_up``), a stale engine stays out of
    routing until someone loads the current weights into it."""
    with two_scripted() as (engines, urls):
        clients = [SGLangClient(u, retries=0) for u in urls]
        affine = SessionAffineEngines(clients, urls)

        async def probe(i: int) -> str | None:
            return None if await clients[i].health(read_timeout=1) else "unhealthy"

        async def info(i: int) -> ModelInfo:
            return await clients[i].get_model_info()

        monitor = HealthMonitor(urls, probe, model_info=info, interval_s=0.05)
        affine.monitor = monitor
        key = _key_ranking_first(urls, 1)
        running = asyncio.create_task(monitor.run())
        try:
            await _until("both up", lambda: monitor.up() == [0, 1])
            engines[1].healthy = False
            await _until("engine 1 down", lambda: monitor.state(1) == "down")
            engines[0].weight_version = "v2"  # a weight push that engine 1 missed
            engines[1].healthy = True
            await _until("engine 1 stale", lambda: monitor.state(1) == "stale")
            snapshot = monitor.snapshot()[1]
            assert "'default'" in snapshot["detail"] and "'v2'" in snapshot["detail"]
            assert "held out" in snapshot["detail"]
            before = len(engines[1].requests)
            out = await affine.generate(_request(key))
            assert out.meta_info.weight_version == "v2"  # served by engine 0
            assert len(engines[1].requests) == before
            await asyncio.sleep(0.2)  # several rounds: still held out
            assert monitor.state(1) == "stale"
            await clients[1].update_weights_from_disk("/ckpt/v2", weight_version="v2")
            await _until("engine 1 up", lambda: monitor.state(1) == "up")
            out = await affine.generate(_request(key))
            assert len(engines[1].requests) == before + 1
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await affine.aclose()


async def test_the_gateway_loads_the_current_weights_into_a_revived_sglang_engine() -> None:
    """``engine_monitor`` (what ``create_gateway`` runs): a revived engine is sent
    ``update_weights_from_disk`` with the folder and version an up engine reports."""
    with two_scripted() as (engines, urls):
        clients = [SGLangClient(u, retries=0) for u in urls]
        affine = SessionAffineEngines(clients, urls)
        monitor = affine.monitor = engine_monitor(affine, "sglang", interval_s=0.05)
        running = asyncio.create_task(monitor.run())
        try:
            await _until("both up", lambda: monitor.up() == [0, 1])
            engines[1].healthy = False
            await _until("engine 1 down", lambda: monitor.state(1) == "down")
            engines[0].weight_version, engines[0].model_path = "v7", "/ckpt/v7"
            engines[1].healthy = True
            await _until("engine 1 up", lambda: monitor.state(1) == "up")
            assert engines[1].weight_version == "v7"
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await affine.aclose()


# --- the monitor alone, on a fake clock ------------------------------------------------------


class FakeEngines:
    """Stand-ins for the engines: what each probe answers and each version, per index."""

    def __init__(self, n: int) -> None:
        self.problem: list[str | None] = [None] * n
        self.version: list[str | None] = ["v1"] * n
        self.loads: list[tuple[int, str | None]] = []
        self.load_fails = False

    async def probe(self, i: int) -> str | None:
        return self.problem[i]

    async def info(self, i: int) -> ModelInfo:
        return ModelInfo(model_path=f"/ckpt/{self.version[i]}", weight_version=self.version[i])

    async def catch_up(self, i: int, reference: ModelInfo) -> None:
        self.loads.append((i, reference.weight_version))
        if self.load_fails:
            raise RuntimeError("no such folder")
        self.version[i] = reference.weight_version


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _monitor(fake: FakeEngines, clock: FakeClock, **kwargs: Any) -> HealthMonitor:
    return HealthMonitor(
        [f"http://e{i}" for i in range(len(fake.problem))],
        fake.probe,
        model_info=fake.info,
        clock=clock,
        **kwargs,
    )


async def test_the_monitor_marks_a_hung_engine_down_within_10_s_with_one_line_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, clock = FakeEngines(2), FakeClock()
    monitor = _monitor(fake, clock)
    assert monitor.routable(0) and monitor.state(0) == "unknown"
    with caplog.at_level(logging.INFO, "corral.engines.health"):
        await monitor.check()
        assert monitor.up() == [0, 1]
        hung_at = clock.now + 0.1  # just after a good probe
        fake.problem[0] = "no answer within 2.5 s"
        down = monitor.down_signal(0)
        while monitor.state(0) == "up":
            clock.now += monitor.interval_s + monitor.probe_timeout_s  # each probe times out
            await monitor.check()
        assert monitor.state(0) == "down" and not monitor.routable(0) and down.is_set()
        assert clock.now - hung_at < 10
        await monitor.check()  # still down: no new line
        fake.problem[0] = None
        await monitor.check()
        assert monitor.state(0) == "up" and not down.is_set()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines  # e0 up, e1 up, e0 down, e0 up
    assert "http://e0 is down" in lines[2] and "no answer within 2.5 s" in lines[2]


async def test_one_failed_probe_is_not_down_and_a_probe_that_hangs_times_out() -> None:
    fake, clock = FakeEngines(1), FakeClock()
    hang = asyncio.Event()

    async def probe(i: int) -> str | None:
        if hang.is_set():
            await asyncio.Event().wait()
        return await fake.probe(i)

    monitor = HealthMonitor(["http://e0"], probe, clock=clock, probe_timeout_s=0.05)
    await monitor.check()
    hang.set()
    await monitor.check()
    assert monitor.state(0) == "up"
    await monitor.check()
    assert monitor.state(0) == "down"
    assert monitor.snapshot()[0]["detail"] == "no answer within 0.05 s"


async def test_a_stale_engine_is_caught_up_once_per_version_else_held_out() -> None:
    fake, clock = FakeEngines(2), FakeClock()
    monitor = _monitor(fake, clock, catch_up=fake.catch_up, failures_to_down=1)
    await monitor.check()
    fake.problem[1] = "connection refused"
    await monitor.check()
    fake.version[0], fake.problem[1] = "v2", None
    fake.load_fails = True
    await monitor.check()
    assert monitor.state(1) == "stale" and not monitor.routable(1)
    await asyncio.sleep(0.01)  # the catch-up task runs (and fails)
    for _ in range(3):
        await monitor.check()
    assert fake.loads == [(1, "v2")]  # tried once for v2
    assert "loading the current weights into it failed" in monitor.snapshot()[1]["detail"]
    fake.version[0] = "v3"  # the next push: tried again, and it works
    fake.load_fails = False
    await monitor.check()
    await asyncio.sleep(0.01)
    await monitor.check()
    assert fake.loads == [(1, "v2"), (1, "v3")] and monitor.state(1) == "up"


async def test_revival_waits_while_the_up_engines_disagree_and_no_up_engine_means_majority() -> (
    None
):
    fake, clock = FakeEngines(3), FakeClock()
    monitor = _monitor(fake, clock, failures_to_down=1)
    fake.version = ["v1", "v2", "v2"]
    await monitor.check()  # nothing up yet: the most common version is current
    assert monitor.up() == [1, 2] and monitor.state(0) == "stale"
    fake.version[1] = "v3"  # mid-push: the up engines disagree
    await monitor.check()
    assert monitor.state(0) == "stale"
    assert "serve different weights" in monitor.snapshot()[0]["detail"]
    fake.version = ["v3", "v3", "v3"]
    await monitor.check()
    assert monitor.up() == [0, 1, 2]


async def test_run_probes_every_interval_until_cancelled() -> None:
    fake, clock = FakeEngines(1), FakeClock()
    slept: list[float] = []
    third = asyncio.Event()

    async def sleep(delay: float) -> None:
        slept.append(delay)
        clock.now += delay
        if len(slept) == 3:
            third.set()
            await asyncio.Event().wait()

    monitor = HealthMonitor(["http://e0"], fake.probe, clock=clock, sleep=sleep, interval_s=2)
    running = asyncio.create_task(monitor.run())
    await third.wait()
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    assert slept == [2, 2, 2] and monitor.rounds == 3
