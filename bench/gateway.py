"""The gateway's cost: the same engine and prompts, straight to the engine vs through the gateway.

Run: ``python bench/gateway.py [--sessions 1 64 256] [--turns 3] [--max-tokens 16]``.

The engine (``corral engine``) and the gateway (``corral gateway``) run as separate processes,
the engine pinned to one torch thread so the gateway has CPU to work with, as it would beside
a GPU engine. A warm-up pass through the gateway records every turn's request and the exact
prompt ids the gateway sent; the measured passes then replay those same turns, straight to
``/generate`` with the recorded ids and through the gateway with the recorded messages, so
both paths make the engine do the same work (greedy decoding). The load generator is aiohttp
(httpx costs several ms of client CPU per request on these cores).

Prints, per concurrency: turns/s and per-turn latency p50/p99 on each path, the gateway's
added latency (p50, p99) and the throughput ratio; then memory per held session for long
multi-turn sessions (RSS of the gateway process before and after filling them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ADMIN_VAR = "CORRAL_BENCH_ADMIN"
ADMIN = "bench-admin"
USER_TURNS = [
    "What is the weather in Paris?",
    "And in Tokyo?",
    "Say hello.",
    "What is the weather in Lima and Oslo?",
    "Thanks. Say hello.",
]


@dataclass
class Turn:
    body: dict[str, Any]  # the chat request through the gateway
    input_ids: list[int]  # what the gateway sent to the engine for it
    max_new_tokens: int


@contextmanager
def process(
    args: list[str], env: dict[str, str], health_url: str
) -> Iterator[subprocess.Popen[bytes]]:
    # stderr to a file: an unread pipe fills up and blocks the server mid-benchmark.
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            if not asyncio.run(_wait_healthy(health_url, proc)):
                log.seek(0)
                raise RuntimeError(f"{args} did not start: {log.read().decode()[-2000:]}")
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + 120
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                async with http.get(url) as r:
                    if r.status == 200:
                        return True
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)  # polling a process we started, not test synchronisation
    return False


async def _get_text(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return await r.text()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def new_session(http: aiohttp.ClientSession, gateway: str) -> dict[str, Any]:
    async with http.post(
        f"{gateway}/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"}
    ) as r:
        r.raise_for_status()
        return dict(await r.json())


async def chat(
    http: aiohttp.ClientSession, session: dict[str, Any], body: dict[str, Any]
) -> dict[str, Any]:
    async with http.post(
        f"{session['base_url']}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {session['api_key']}"},
    ) as r:
        if r.status != 200:
            raise RuntimeError(f"gateway answered {r.status}: {await r.text()}")
        return dict(await r.json())


async def record_conversations(
    gateway: str, model: str, sessions: int, turns: int, max_tokens: int
) -> list[list[Turn]]:
    """Warm-up: play each conversation once through the gateway (so assistant turns are the
    model's own), then render every turn's request with the gateway's own renderer, which
    gives exactly the prompt ids the gateway sends to the engine."""
    from transformers import AutoTokenizer

    from corral.gateway.openai_types import ChatCompletionRequest
    from corral.gateway.rendering import ChatRenderer, template_messages, template_tools

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model))
    async with aiohttp.ClientSession() as http:

        async def one(k: int) -> list[dict[str, Any]]:
            session = await new_session(http, gateway)
            messages: list[dict[str, Any]] = []
            bodies = []
            for t in range(turns):
                messages.append({"role": "user", "content": USER_TURNS[(k + t) % len(USER_TURNS)]})
                body = {
                    "model": "tiny",
                    "messages": list(messages),
                    "temperature": 0,
                    "max_tokens": max_tokens,
                }
                reply = await chat(http, session, body)
                message = reply["choices"][0]["message"]
                messages.append({"role": "assistant", "content": message.get("content") or ""})
                bodies.append(body)
            return bodies

        conversations = await asyncio.gather(*(one(k) for k in range(sessions)))
    out = []
    for bodies in conversations:
        rendered = []
        for body in bodies:
            req = ChatCompletionRequest.model_validate(body)
            prompt = renderer.render(template_messages(req.messages), template_tools(req.tools))
            rendered.append(Turn(body, prompt.token_ids, max_tokens))
        out.append(rendered)
    return out


async def run_direct(engine: str, conversations: list[list[Turn]]) -> tuple[list[float], float]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(turns: list[Turn]) -> list[float]:
            out = []
            for turn in turns:
                payload = {
                    "input_ids": turn.input_ids,
                    "sampling_params": {"max_new_tokens": turn.max_new_tokens, "temperature": 0},
                    "return_logprob": True,
                }
                t0 = time.perf_counter()
                async with http.post(f"{engine}/generate", json=payload) as r:
                    r.raise_for_status()
                    await r.json()
                out.append(time.perf_counter() - t0)
            return out

        t0 = time.perf_counter()
        lat = await asyncio.gather(*(one(c) for c in conversations))
        return [x for xs in lat for x in xs], time.perf_counter() - t0


async def run_gateway(gateway: str, conversations: list[list[Turn]]) -> tuple[list[float], float]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        sessions = [await new_session(http, gateway) for _ in conversations]

        async def one(session: dict[str, Any], turns: list[Turn]) -> list[float]:
            # Played live, as an agent would: each turn's history holds the replies this
            # session got (batch composition can change a greedy reply; replaying the warm-up's
            # replies would make every such turn a fork).
            out = []
            history: list[dict[str, Any]] = []
            for turn in turns:
                history.append(turn.body["messages"][-1])
                t0 = time.perf_counter()
                reply = await chat(http, session, {**turn.body, "messages": list(history)})
                out.append(time.perf_counter() - t0)
                content = reply["choices"][0]["message"].get("content") or ""
                history.append({"role": "assistant", "content": content})
            return out

        t0 = time.perf_counter()
        lat = await asyncio.gather(
            *(one(s, c) for s, c in zip(sessions, conversations, strict=True))
        )
        elapsed = time.perf_counter() - t0
        for s in sessions:
            async with http.delete(
                f"{gateway}/sessions/{s['id']}", headers={"Authorization": f"Bearer {ADMIN}"}
            ):
                pass
        return [x for xs in lat for x in xs], elapsed


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def fill_sessions(gateway: str, sessions: int, turns: int) -> int:
    """Long multi-turn sessions held by the gateway; returns the tokens they hold."""
    async with aiohttp.ClientSession() as http:

        async def one(k: int) -> int:
            session = await new_session(http, gateway)
            messages: list[dict[str, Any]] = []
            for t in range(turns):
                messages.append({"role": "user", "content": USER_TURNS[(k + t) % len(USER_TURNS)]})
                reply = await chat(
                    http,
                    session,
                    {
                        "model": "tiny",
                        "messages": list(messages),
                        "temperature": 0,
                        "max_tokens": 16,
                    },
                )
                messages.append(
                    {
                        "role": "assistant",
                        "content": reply["choices"][0]["message"].get("content") or "",
                    }
                )
            async with http.get(
                f"{session['base_url'].rsplit('/v1', 1)[0]}/samples",
                headers={"Authorization": f"Bearer {ADMIN}"},
            ) as r:
                return sum(len(s["tokens"]) for s in await r.json())

        return sum(await asyncio.gather(*(one(k) for k in range(sessions))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--min-turns", type=int, default=400, help="turns per path and level, at least"
    )
    parser.add_argument("--model", help="model folder (default: build the tiny model)")
    parser.add_argument("--memory-sessions", type=int, default=32)
    parser.add_argument("--memory-turns", type=int, default=30)
    args = parser.parse_args()
    console = Console()

    model = args.model
    if model is None:
        from corral.engines.tiny_model import cached_tiny_model

        console.print("the tiny model (built once, then cached) ...")
        model = str(cached_tiny_model("qwen25"))
    from corral.serving import free_port

    ep, gp = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", ADMIN_VAR: ADMIN}
    engine = f"http://127.0.0.1:{ep}"
    gateway = f"http://127.0.0.1:{gp}"
    corral = [sys.executable, "-m", "corral.cli"]
    with (
        process([*corral, "engine", "--model", model, "--port", str(ep)], env, f"{engine}/health"),
        process(
            [
                *corral,
                "gateway",
                "--engine-url",
                engine,
                "--model",
                model,
                "--port",
                str(gp),
                "--admin-token-var",
                ADMIN_VAR,
            ],
            env,
            f"{gateway}/health",
        ) as gw_proc,
    ):
        table = Table(title="straight to the engine vs through the gateway (per turn)")
        for col in (
            "sessions",
            "turns",
            "direct turns/s",
            "gateway turns/s",
            "ratio",
            "direct p50 ms",
            "gateway p50 ms",
            "added p50 ms",
            "added p99 ms",
            "gateway CPU ms/turn",
        ):
            table.add_column(col, justify="right")
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("concurrency levels", total=len(args.sessions))
            for n in args.sessions:
                conversations = asyncio.run(
                    record_conversations(gateway, model, n, args.turns, args.max_tokens)
                )
                # Enough rounds for stable percentiles; alternate the paths round by round so
                # neither always runs on a warmer (or busier) machine.
                rounds = max(2, -(-args.min_turns // (n * args.turns)))
                direct: list[float] = []
                gw: list[float] = []
                d_time = g_time = g_cpu = 0.0
                for _ in range(rounds):
                    lat, took = asyncio.run(run_direct(engine, conversations))
                    direct += lat
                    d_time += took
                    cpu0 = cpu_seconds(gw_proc.pid)
                    lat, took = asyncio.run(run_gateway(gateway, conversations))
                    g_cpu += cpu_seconds(gw_proc.pid) - cpu0
                    gw += lat
                    g_time += took
                d_tps = len(direct) / d_time
                g_tps = len(gw) / g_time
                table.add_row(
                    str(n),
                    str(len(gw)),
                    f"{d_tps:.1f}",
                    f"{g_tps:.1f}",
                    f"{g_tps / d_tps:.3f}",
                    f"{1e3 * statistics.median(direct):.2f}",
                    f"{1e3 * statistics.median(gw):.2f}",
                    f"{1e3 * (statistics.median(gw) - statistics.median(direct)):.2f}",
                    f"{1e3 * (pct(gw, 0.99) - pct(direct, 0.99)):.2f}",
                    f"{1e3 * g_cpu / len(gw):.2f}",
                )
                progress.advance(task)
        console.print(table)

        metrics = asyncio.run(_get_text(f"{gateway}/metrics"))
        decisions = [
            line for line in metrics.splitlines() if line.startswith("corral_gateway_merge_")
        ]
        console.print("merge decisions during the benchmark: " + "; ".join(decisions))

        before = rss_bytes(gw_proc.pid)
        tokens = asyncio.run(fill_sessions(gateway, args.memory_sessions, args.memory_turns))
        after = rss_bytes(gw_proc.pid)
        per_session = (after - before) / args.memory_sessions
        console.print(
            f"memory: {args.memory_sessions} sessions x {args.memory_turns} turns hold "
            f"{tokens} tokens; gateway RSS +{(after - before) / 1e6:.1f} MB = "
            f"{per_session / 1e3:.1f} kB per session, "
            f"{(after - before) / max(tokens, 1):.1f} B per held token"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
