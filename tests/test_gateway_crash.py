"""A gateway killed mid-run and started again on its journal: every session goes on.

Real parts: ``corral gateway --journal`` as a child process (SIGKILLed, then started again on
the same port and folder), the OpenAI SDK as the clients (its own retries carry them over the
restart), the gateway's admin API. The engine is the scripted TEST engine
(tests/scripted_engine.py, SGLang's API on 127.0.0.1), answering each prompt with tokens that
depend only on the prompt, so that a run without the crash gives the samples to compare with.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from corral.gateway.launch import GatewayLaunch
from corral.processes import ChildServer, child_server
from corral.serving import free_port
from tests.scripted_engine import ScriptedEngine
from tests.servers import serve

SESSIONS = 256
TURNS = 4
ADMIN = "crash-test-admin"
ADMIN_VAR = "CORRAL_CRASH_TEST_ADMIN"


def replying(tokenizer: Any) -> Callable[[list[int]], list[int]]:
    """The engine's answer to a prompt: a short text chosen by the prompt's checksum."""
    end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def reply(input_ids: list[int]) -> list[int]:
        word = ["north", "south", "east", "west", "wait"][zlib.crc32(str(input_ids).encode()) % 5]
        ids = list(tokenizer(f"go {word} then look", add_special_tokens=False).input_ids)
        return [*ids, end]

    return reply


async def play(url: str, sessions: list[dict[str, Any]], turns: range) -> None:
    """Play ``turns`` of every session at once, each through its own OpenAI client."""

    async def one(s: dict[str, Any]) -> None:
        client = openai.AsyncOpenAI(
            base_url=s["base_url"], api_key=s["api_key"], max_retries=12, timeout=60
        )
        async with client:
            for turn in turns:
                answer = await client.chat.completions.create(
                    model="tiny", messages=s["messages"], temperature=0
                )
                s["messages"] += [
                    {"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": f"you are at step {turn + 1}"},
                ]

    await asyncio.gather(*(one(s) for s in sessions))


async def open_sessions(url: str) -> list[dict[str, Any]]:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as admin:
        made = []
        for k in range(SESSIONS):
            r = await admin.post("/sessions", json={"metadata": {"k": k}, "group_index": k})
            assert r.status_code == 201, r.text
            made.append({**r.json(), "messages": [{"role": "user", "content": f"task {k}"}]})
        return made


async def samples_of(url: str, sessions: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as admin:
        out = []
        for s in sessions:
            r = await admin.get(f"/sessions/{s['id']}/samples")
            assert r.status_code == 200, r.text
            out.append(r.json())
        return out


def comparable(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What must be equal across the two runs: everything but the session's own ids."""
    kept = ("tokens", "response_length", "loss_mask", "rollout_log_probs", "status", "reward")
    return [
        {
            **{k: s[k] for k in kept},
            "turns": s["metadata"]["num_turns"],
            "task": s["metadata"]["k"],
            "history": s["metadata"]["history_modes"],
        }
        for s in samples
    ]


@pytest.mark.timeout(600)
def test_sessions_survive_a_sigkilled_gateway_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    reply = replying(tokenizer)
    # The gateway is killed once this many engine requests came: all of turn 2's and part of
    # turn 3's, so that some turns are in flight (engine done, answer not yet out) when it dies.
    kill_at = SESSIONS * 2 + SESSIONS // 4
    gateway: dict[str, ChildServer] = {}
    killed = threading.Event()
    calls = 0
    lock = threading.Lock()

    def scripted(input_ids: list[int]) -> list[int]:
        nonlocal calls
        with lock:
            calls += 1
            if calls == kill_at and "crashing" in gateway:
                os.kill(gateway["crashing"].process.pid, signal.SIGKILL)
                killed.set()
        return reply(input_ids)

    engine = ScriptedEngine(
        eos_token_ids=[int(tokenizer.convert_tokens_to_ids("<|im_end|>"))], default=scripted
    )
    env = {ADMIN_VAR: ADMIN}
    with serve(engine.app) as engine_url, ExitStack() as stack:

        def start(name: str, journal: Path, port: int) -> ChildServer:
            launch = GatewayLaunch(
                engine_url=engine_url,
                model=tiny_model_dir,
                admin_token_var=ADMIN_VAR,
                served_model_name="tiny",
                journal_dir=journal,
                max_sessions=4 * SESSIONS,
            )
            child = stack.enter_context(
                child_server(launch.to_argv(), log=tmp_path / f"{name}.log", port=port, env=env)
            )
            gateway[name] = child
            return child

        # The run without a crash, for the samples to compare with.
        calm = start("calm", tmp_path / "calm-journal", free_port())
        calm_sessions = asyncio.run(open_sessions(calm.url))
        asyncio.run(play(calm.url, calm_sessions, range(TURNS)))
        expected = [comparable(s) for s in asyncio.run(samples_of(calm.url, calm_sessions))]
        calm_calls = calls

        journal = tmp_path / "journal"
        port = free_port()
        crashing = start("crashing", journal, port)
        sessions = asyncio.run(open_sessions(crashing.url))
        with lock:
            calls = 0

        async def crash_and_go_on() -> None:
            first_half = asyncio.ensure_future(play(crashing.url, sessions, range(2)))
            await first_half
            rest = asyncio.ensure_future(play(crashing.url, sessions, range(2, TURNS)))
            # Started again the moment the old one is dead, on the same port and journal,
            # while the clients' requests are failing and being retried.
            await asyncio.to_thread(killed.wait, 300)
            assert killed.is_set(), "the gateway was never killed"
            await asyncio.to_thread(crashing.process.wait, 30)
            await asyncio.to_thread(start, "restarted", journal, port)
            await rest

        asyncio.run(crash_and_go_on())
        assert crashing.process.returncode == -signal.SIGKILL
        got = [comparable(s) for s in asyncio.run(samples_of(gateway["restarted"].url, sessions))]

    # Every session finished: one sample each, every turn in it once, equal token for token to
    # the run without the crash.
    assert all(len(s) == 1 and s[0]["turns"] == TURNS for s in got)
    assert got == expected
    # Some turns were cut off by the kill and played again after it (the engine saw them twice).
    assert calm_calls == SESSIONS * TURNS
    assert calls > SESSIONS * TURNS
    log = (tmp_path / "restarted.log").read_text()
    assert f"{SESSIONS} live sessions rebuilt" in log


def test_a_damaged_journal_stops_the_gateway_with_one_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``corral gateway --journal`` on a journal whose middle record is damaged refuses to
    start (exit 1, one line naming the file) instead of rebuilding sessions wrongly."""
    journal = tmp_path / "journal"
    journal.mkdir()
    good = b'{"k":"close","s":"x"}'
    line = b"%08x %s\n" % (zlib.crc32(good), good)
    (journal / "segment-000001.log").write_bytes(line + b'00000000 {"k":1}\n' + line)
    launch = GatewayLaunch(
        engine_url="http://127.0.0.1:9", model=tiny_model_dir, journal_dir=journal
    )
    done = subprocess.run(
        [sys.executable, "-m", "corral.cli", *launch.to_argv(), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("corral gateway:")]
    assert len(errors) == 1 and "segment-000001.log" in errors[0], done.stderr
    assert "damaged record before the journal's end" in errors[0]
