"""The env server's cost and load, with OpenEnv's own echo server as the baseline.

Run: ``python bench/envs.py [--episodes 512] [--solo-steps 1000] [--plot PATH]``.

(1) The server's own cost: ``corral serve bundles/gridsim`` in its own (torch-free) process,
one episode at a time through :class:`corral.envs.client.EnvClient`; the round trip of a
``simulate_schedule`` step (p50/p99) and the server's CPU time per step (utime + stime from
``/proc/PID/stat``, before and after). Target: p50 under 2 ms.

(2) Load: ``--episodes`` (512) gridsim episodes at once (``--max-concurrent-envs`` as many),
each reset + ``--sim-steps`` simulate steps + submit, driven in a closed loop over raw
WebSocket frames (the ``websockets`` library); episodes/s, step p50/p99, server CPU per
message, server memory per live episode (peak RSS over the idle RSS, over the episodes) and
the errors. Target: all complete, no error.

Baseline, same run and same load generator: OpenEnv's echo env (``openenv-core``'s
``create_app`` with an echo environment like OpenEnv's ``envs/echo_env``; the package does
not ship it) served by uvicorn under the openenv venv's python, with 24 echo steps per episode
in OpenEnv's wire shapes. The venv comes from ``scripts/openenv_venv.sh`` (or point
``CORRAL_OPENENV_PYTHON`` at one); without it the baseline is skipped.

Everything is bounded: messages by ``--message-timeout``, each load phase by
``--phase-timeout``; servers listen on 127.0.0.1 only and are stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.envs.client import EnvClient
from corral.serving import free_port

ROOT = Path(__file__).resolve().parents[1]
GRIDSIM = ROOT / "bundles" / "gridsim"
DEFAULT_OPENENV_PYTHON = ROOT / ".openenv-venv" / "bin" / "python"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# A schedule that charges at 03:00 and sells at 19:00 (valid for any positive capacity).
SCHEDULE = [0] * 24
SCHEDULE[3], SCHEDULE[19] = 1, -1
ECHO_STEPS = 24

# OpenEnv's echo env, minus its MCP tools (the WebSocket path never uses them): EchoAction
# {message} -> EchoObservation {echoed_message, message_length}, reward 0.1 per character.
ECHO_SERVER = """
import sys
from uuid import uuid4

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str
    message_length: int = 0


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return EchoObservation(echoed_message="Echo environment ready!", reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        n = len(action.message)
        return EchoObservation(
            echoed_message=action.message,
            message_length=n,
            reward=n * 0.1,
            metadata={"original_message": action.message, "step": self._state.step_count},
        )

    @property
    def state(self):
        return self._state


app = create_app(
    EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=int(sys.argv[2])
)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


# ---------------------------------------------------------------------------------------------
# processes


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@contextmanager
def server_process(args: list[str], port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server, wait for ``GET /health`` (30 s at most), stop it on exit."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{args[0]} exited ({proc.returncode}): {log.read_text()[-2000:]}"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} not healthy after 30 s: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# ---------------------------------------------------------------------------------------------
# measurements


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass
class Solo:
    steps: list[float]  # seconds per simulate round trip
    cpu_per_step: float  # server seconds per step


@dataclass
class Load:
    name: str
    episodes: int
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)  # seconds per step round trip
    messages: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    rss_idle: int = 0
    rss_peak: int = 0
    peak_live: int = 0
    timed_out: bool = False

    @property
    def episodes_per_s(self) -> float:
        return self.completed / self.wall if self.wall else 0.0


async def solo(url: str, pid: int, steps: int, console: Console, progress: Progress) -> Solo:
    """One episode at a time: reset, ``simulate_schedule`` steps, submit; time the simulates."""
    per_episode = 25  # under gridsim's cap of simulations per episode
    latencies: list[float] = []
    cpu_time = 0.0
    task = progress.add_task("solo: simulate steps", total=steps)
    async with EnvClient(url, timeout=30, reset_timeout=30) as client:
        await client.reset("train", 0)  # warm-up (imports, first task load)
        await client.call_tool("simulate_schedule", {"schedule": SCHEDULE})
        await client.call_tool("submit_schedule", {"schedule": SCHEDULE})
        episode = 0
        while len(latencies) < steps:
            await client.reset("train", episode % 2000)
            n = min(per_episode, steps - len(latencies))
            cpu0 = cpu_seconds(pid)
            for _ in range(n):
                t0 = time.perf_counter()
                obs = await client.call_tool("simulate_schedule", {"schedule": SCHEDULE})
                latencies.append(time.perf_counter() - t0)
                if obs.observation.is_error:
                    raise RuntimeError(f"simulate_schedule refused: {obs.observation.text}")
            cpu_time += cpu_seconds(pid) - cpu0
            progress.advance(task, n)
            await client.call_tool("submit_schedule", {"schedule": SCHEDULE})
            episode += 1
    return Solo(latencies, cpu_time / len(latencies))


async def _rpc(ws: Any, message: dict[str, Any], limit_s: float) -> dict[str, Any]:
    await ws.send(json.dumps(message))
    reply = json.loads(await asyncio.wait_for(ws.recv(), limit_s))
    if reply.get("type") != "observation":
        raise RuntimeError(f"{message['type']}: {reply}")
    return reply["data"]


async def load(
    name: str,
    url: str,
    pid: int,
    episodes: int,
    script: list[dict[str, Any]],
    reset: dict[str, Any] | Any,
    progress: Progress,
    message_timeout: float,
    phase_timeout: float,
) -> Load:
    """``episodes`` workers, each one socket playing one episode: reset, then ``script``'s
    steps (the last must end a gridsim episode); all started at once (closed loop)."""
    result = Load(name, episodes)
    ws_url = url.replace("http://", "ws://") + "/ws"
    live = 0
    task = progress.add_task(f"load: {name}", total=episodes)
    gate = asyncio.Event()

    async def worker(i: int) -> None:
        nonlocal live
        try:
            async with websockets.connect(
                ws_url, open_timeout=message_timeout, max_size=None
            ) as ws:
                await gate.wait()
                await _rpc(ws, {"type": "reset", "data": reset(i)}, message_timeout)
                live += 1
                result.peak_live = max(result.peak_live, live)
                try:
                    data: dict[str, Any] = {}
                    for step in script:
                        t0 = time.perf_counter()
                        data = await _rpc(ws, {"type": "step", "data": step}, message_timeout)
                        result.steps.append(time.perf_counter() - t0)
                    result.messages += len(script) + 1
                finally:
                    live -= 1
                if script[-1].get("type") == "call_tool" and not data.get("done"):
                    raise RuntimeError(f"episode {i} not done after submit: {data}")
                await ws.send(json.dumps({"type": "close"}))
            result.completed += 1
        except Exception as exc:  # counted and reported; the run goes on
            result.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            progress.advance(task)

    async def sample_rss() -> None:
        while True:
            result.rss_peak = max(result.rss_peak, rss_bytes(pid))
            await asyncio.sleep(0.02)

    result.rss_idle = rss_bytes(pid)
    sampler = asyncio.create_task(sample_rss())
    workers = [asyncio.create_task(worker(i)) for i in range(episodes)]
    await asyncio.sleep(0)  # let the sockets start connecting before the clock starts
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    gate.set()
    _, pending = await asyncio.wait(workers, timeout=phase_timeout)
    result.wall = time.perf_counter() - t0
    result.cpu = cpu_seconds(pid) - cpu0
    for w in pending:
        w.cancel()
    if pending:
        result.timed_out = True
        await asyncio.gather(*pending, return_exceptions=True)
    sampler.cancel()
    return result


# ---------------------------------------------------------------------------------------------
# output


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def plot(path: Path, series: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 5))
    for label, values in series.items():
        if not values:
            continue
        ordered = np.sort(np.asarray(values) * 1000)
        ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)
    ax.axhline(0.5, color="grey", linestyle=":", linewidth=1)
    ax.axhline(0.99, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("step round trip (ms, log scale)")
    ax.set_ylabel("fraction of steps at or below (dotted: p50, p99)")
    ax.set_title("env server step latency (loopback, 2-core box)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def openenv_python(arg: str | None) -> Path | None:
    configured = arg or os.environ.get("CORRAL_OPENENV_PYTHON")
    if configured:
        return Path(configured)
    return DEFAULT_OPENENV_PYTHON if DEFAULT_OPENENV_PYTHON.exists() else None


async def main(args: argparse.Namespace) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=170)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * args.episodes + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    logs = Path(tempfile.mkdtemp(prefix="corral-bench-envs-"))
    loads: list[Load] = []
    solo_result: Solo | None = None

    port = free_port("127.0.0.1")
    corral_cmd = [
        sys.executable,
        "-m",
        "corral.cli",
        "serve",
        str(GRIDSIM),
        "--port",
        str(port),
        "--max-concurrent-envs",
        str(args.episodes),
    ]
    console.print(f"[bold]corral[/]: {' '.join(corral_cmd[1:])}  (log {logs / 'corral.log'})")
    sim = {
        "type": "call_tool",
        "tool_name": "simulate_schedule",
        "arguments": {"schedule": SCHEDULE},
    }
    submit = {
        "type": "call_tool",
        "tool_name": "submit_schedule",
        "arguments": {"schedule": SCHEDULE},
    }
    with Progress(console=console, transient=True) as progress:
        with server_process(corral_cmd, port, logs / "corral.log") as proc:
            url = f"http://127.0.0.1:{port}"
            solo_result = await solo(url, proc.pid, args.solo_steps, console, progress)
            loads.append(
                await load(
                    "corral gridsim",
                    url,
                    proc.pid,
                    args.episodes,
                    [sim] * args.sim_steps + [submit],
                    lambda i: {"split": "train", "index": i % 2000},
                    progress,
                    args.message_timeout,
                    args.phase_timeout,
                )
            )

        python = openenv_python(args.openenv_python)
        if python is None or not python.exists():
            console.print(
                "[yellow]OpenEnv baseline skipped[/]: no openenv-core venv. Create one with "
                "`scripts/openenv_venv.sh .openenv-venv` (or set CORRAL_OPENENV_PYTHON)."
            )
        else:
            script = logs / "openenv_echo_server.py"
            script.write_text(ECHO_SERVER)
            port = free_port("127.0.0.1")
            echo_cmd = [str(python), str(script), str(port), str(args.episodes)]
            console.print(f"[bold]openenv[/]: {' '.join(echo_cmd)}  (log {logs / 'openenv.log'})")
            with server_process(echo_cmd, port, logs / "openenv.log") as proc:
                loads.append(
                    await load(
                        f"openenv echo ({ECHO_STEPS} steps)",
                        f"http://127.0.0.1:{port}",
                        proc.pid,
                        args.episodes,
                        [{"message": f"echo {k:02d} hello"} for k in range(ECHO_STEPS)],
                        lambda i: {},
                        progress,
                        args.message_timeout,
                        args.phase_timeout,
                    )
                )

    assert solo_result is not None
    s = solo_result.steps
    target = "[green]met[/]" if pct(s, 50) < 0.002 else "[red]missed[/]"
    console.print(
        f"\n[bold](1) server cost[/], one episode at a time, {len(s)} simulate_schedule steps "
        f"through EnvClient: p50 {ms(pct(s, 50))} ms, p99 {ms(pct(s, 99))} ms, "
        f"mean {ms(statistics.fmean(s))} ms; server CPU {ms(solo_result.cpu_per_step)} ms/step "
        f"(target p50 < 2 ms: {target})"
    )
    table = Table(title=f"(2) load: {args.episodes} concurrent episodes, closed loop")
    for col in (
        "server",
        "done",
        "errors",
        "wall s",
        "episodes/s",
        "steps/s",
        "step p50 ms",
        "step p99 ms",
        "CPU ms/msg",
        "RSS idle MB",
        "peak live",
        "KB/episode",
    ):
        table.add_column(col, justify="right")
    for r in loads:
        msgs = max(r.messages, 1)
        table.add_row(
            r.name,
            f"{r.completed}/{r.episodes}" + (" (timed out)" if r.timed_out else ""),
            str(len(r.errors)),
            f"{r.wall:.2f}",
            f"{r.episodes_per_s:.1f}",
            f"{len(r.steps) / r.wall if r.wall else 0:.0f}",
            ms(pct(r.steps, 50)),
            ms(pct(r.steps, 99)),
            f"{r.cpu * 1000 / msgs:.3f}",
            f"{r.rss_idle / 2**20:.1f}",
            str(r.peak_live),
            f"{(r.rss_peak - r.rss_idle) / 1024 / r.episodes:.1f}",
        )
    console.print(table)
    for r in loads:
        for err in sorted(set(r.errors))[:5]:
            console.print(f"[red]{r.name} error[/] ({r.errors.count(err)}x): {err}")
    ours = loads[0]
    ok = ours.completed == ours.episodes and not ours.errors
    console.print(
        f"target all {ours.episodes} complete with no error: "
        + ("[green]met[/]" if ok else "[red]missed[/]")
    )
    if len(loads) > 1 and loads[1].episodes_per_s:
        ratio = ours.episodes_per_s / loads[1].episodes_per_s
        console.print(
            f"episodes/s ratio corral gridsim / openenv echo: [bold]{ratio:.2f}x[/] "
            f"({ours.episodes_per_s:.1f} / {loads[1].episodes_per_s:.1f}; corral episodes are "
            f"{args.sim_steps + 1} steps, echo episodes {ECHO_STEPS})"
        )
    series = {f"solo corral simulate (n={len(s)})": s}
    series.update({f"load {r.name} (n={len(r.steps)})": r.steps for r in loads})
    plot(args.plot, series)
    console.print(f"latency plot: {args.plot}")
    return 0 if ok else 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=512, help="concurrent episodes under load")
    p.add_argument("--sim-steps", type=int, default=3, help="simulate steps before the submit")
    p.add_argument("--solo-steps", type=int, default=1000, help="steps in the one-at-a-time run")
    p.add_argument("--message-timeout", type=float, default=60.0, help="seconds per reply")
    p.add_argument("--phase-timeout", type=float, default=180.0, help="seconds per load phase")
    p.add_argument("--openenv-python", help="python of the openenv-core venv")
    p.add_argument(
        "--plot",
        type=Path,
        default=ROOT / ".corral" / "bench" / "envs_latency.png",
        help="where to write the latency PNG",
    )
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
