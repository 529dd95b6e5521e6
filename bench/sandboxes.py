"""Sandbox backends side by side: start latency, exec round trip, warm-pool hand-over.

Run: ``python bench/sandboxes.py [--starts 30] [--execs 100] [--docker]``.

Per backend, measured in one run against ``local`` (a plain subprocess) as the baseline:
- start: ``create`` plus the first ``true`` exec, p50 / p99;
- exec: round trip of ``true`` in a started sandbox, p50 / p99;
- hand-over: ``WarmPool.acquire()`` of a sandbox that is already started, p50.
Targets on the 2-core machine: bwrap start under 50 ms, docker under 1.5 s, hand-over under
5 ms. ``--docker`` adds the docker backend (needs a reachable daemon, ``DOCKER_HOST``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.sandboxes.base import SandboxProvider, SandboxSpec
from corral.sandboxes.pool import WarmPool

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
    await provider.sweep()
    return {
        "start_p50": statistics.median(start),
        "start_p99": pct(start, 0.99),
        "exec_p50": statistics.median(round_trip),
        "exec_p99": pct(round_trip, 0.99),
        "hand_over_p50": statistics.median(hand_over),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=30)
    parser.add_argument("--execs", type=int, default=100)
    parser.add_argument("--docker", action="store_true", help="include the docker backend")
    args = parser.parse_args()
    console = Console()

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

    table = Table(title="sandbox backends (ms; local is the baseline)")
    for col in (
        "backend",
        "start p50",
        "start p99",
        "vs local",
        "exec p50",
        "exec p99",
        "hand-over p50",
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
        )
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
