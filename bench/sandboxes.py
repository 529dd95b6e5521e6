"""Sandbox backends side by side: start latency, exec round trip, warm-pool hand-over.

Run: ``python bench/sandboxes.py [--starts 30] [--execs 100] [--docker]``.

Per backend, measured in one run against ``local`` (a plain subprocess) as the baseline:
- start: ``create`` plus the first ``true`` exec, p50 / p99;
- exec: round trip of ``true`` in a started sandbox, p50 / p99;
- hand-over: ``WarmPool.acquire()`` of a sandbox that is already started, p50;
- env start: what an episode of gridsim waits for before its reset when served with
  ``--sandbox``: a sandbox, the env runner started in it and the env class loaded, p50;
- tool call: one gridsim ``simulate_schedule`` through the runner, p50, against the same call
  on the env in the server's process (``in-process`` row, the baseline of this column).
Targets on the 2-core machine: bwrap start under 50 ms, docker under 1.5 s, hand-over under
5 ms. ``--docker`` adds the docker backend (needs a reachable daemon, ``DOCKER_HOST``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.envs.bundle import Bundle, load_bundle
from corral.envs.hosting import EnvHost, InProcessHost, SandboxHost
from corral.sandboxes.base import SandboxProvider, SandboxSpec
from corral.sandboxes.pool import WarmPool

GRIDSIM = Path(__file__).resolve().parent.parent / "bundles" / "gridsim"

Factory = Callable[[], SandboxProvider]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def measure(make: Factory, starts: int, execs: int, progress: Progress) -> dict[str, float]:
    provider = make()
    spec = SandboxSpec(memory_mb=256, pids=64)
    task = progress.add_task(provider.name, total=starts + execs + starts)
    start: list[float] = []
    for _ in range(starts):
        t0 = time.perf_counter()
        box = await provider.create(spec)
        await box.exec(["true"], timeout=30)
        start.append(time.perf_counter() - t0)
        await box.close()
        progress.advance(task)
    box = await provider.create(spec)
    round_trip = []
    for _ in range(execs):
        t0 = time.perf_counter()
        result = await box.exec(["true"], timeout=30)
        round_trip.append(time.perf_counter() - t0)
        assert result.exit_code == 0, result
        progress.advance(task)
    await box.close()
    # A pool as large as the hand-overs measured: each acquire finds a started sandbox queued.
    pool = WarmPool(provider, spec, size=starts)
    await pool.start(wait=True)
    hand_over = []
    for _ in range(starts):
        t0 = time.perf_counter()
        box = await pool.acquire()
        hand_over.append(time.perf_counter() - t0)
        await box.close()
        progress.advance(task)
    await pool.aclose()
    bundle = load_bundle(GRIDSIM)
    env_start, tool_call = await measure_env(
        SandboxHost(bundle, provider, SandboxSpec(workdir="/work")), bundle, starts, execs
    )
    await provider.sweep()
    return {
        "start_p50": statistics.median(start),
        "start_p99": pct(start, 0.99),
        "exec_p50": statistics.median(round_trip),
        "exec_p99": pct(round_trip, 0.99),
        "hand_over_p50": statistics.median(hand_over),
        "env_start_p50": env_start,
        "tool_call_p50": tool_call,
    }


async def measure_env(
    host: EnvHost, bundle: Bundle, starts: int, calls: int
) -> tuple[float, float]:
    """(env start p50, tool call p50) of gridsim on ``host``."""
    await host.open()
    task = bundle.task("eval", 0)
    start, call = [], []
    try:
        for i in range(starts):
            t0 = time.perf_counter()
            env = await host.start()
            start.append(time.perf_counter() - t0)
            await env.reset(task)
            if i == 0:
                for _ in range(calls):
                    t0 = time.perf_counter()
                    out = await env.call_tool("simulate_schedule", {"schedule": [0] * 24})
                    call.append(time.perf_counter() - t0)
                    assert not out.error, out
            await env.close()
    finally:
        await host.aclose()
    return statistics.median(start), statistics.median(call)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=30)
    parser.add_argument("--execs", type=int, default=100)
    parser.add_argument("--docker", action="store_true", help="include the docker backend")
    args = parser.parse_args()
    console = Console(width=150)

    from corral.sandboxes.bwrap import BwrapProvider
    from corral.sandboxes.local import LocalProvider

    backends: list[tuple[str, Factory]] = [
        ("local", lambda: LocalProvider("bench")),
        ("bwrap", lambda: BwrapProvider("bench")),
    ]
    if args.docker:
        from corral.sandboxes.docker import DockerProvider

        backends.append(("docker", lambda: DockerProvider("bench")))

    results: dict[str, dict[str, float]] = {}
    with Progress(console=console, transient=True) as progress:
        for name, make in backends:
            results[name] = asyncio.run(measure(make, args.starts, args.execs, progress))
    bundle = load_bundle(GRIDSIM)
    _, in_process = asyncio.run(measure_env(InProcessHost(bundle), bundle, 1, args.execs))

    table = Table(title="sandbox backends (ms; local is the baseline)")
    for col in (
        "backend",
        "start p50",
        "start p99",
        "vs local",
        "exec p50",
        "exec p99",
        "hand-over p50",
        "env start p50",
        "tool call p50",
        "vs in-process",
    ):
        table.add_column(col, justify="right")
    base = results["local"]["start_p50"]
    for name, r in results.items():
        table.add_row(
            name,
            f"{1e3 * r['start_p50']:.1f}",
            f"{1e3 * r['start_p99']:.1f}",
            f"{r['start_p50'] / base:.1f}x",
            f"{1e3 * r['exec_p50']:.1f}",
            f"{1e3 * r['exec_p99']:.1f}",
            f"{1e3 * r['hand_over_p50']:.3f}",
            f"{1e3 * r['env_start_p50']:.1f}",
            f"{1e3 * r['tool_call_p50']:.2f}",
            f"{r['tool_call_p50'] / in_process:.1f}x",
        )
    table.add_row("in-process", *[""] * 7, f"{1e3 * in_process:.2f}", "1.0x")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
