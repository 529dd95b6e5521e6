"""Rollouts per second for gridsim, and where each rollout's wall time goes.

Run: ``python bench/rollouts.py [--rollouts 48] [--concurrency 1 8] [--max-turns 2]``.

Everything runs on this machine in one process: the local engine with the tiny model (one
torch thread), the gateway in front of it, gridsim's env server, and the episode player. The
engine's app is wrapped to time every ``/generate`` it serves, so each rollout's wall time
splits into:

- engine: the model's own time (the baseline: what a rollout cannot do without);
- gateway: the model calls' wall time (the OpenAI call through the gateway) minus the engine's;
- tools: the env server round trips (resets excluded: they are in "corral");
- corral: the rest (sessions, reset, samples, the player's own code).

Target: the gateway's and corral's shares together under 5% of a rollout. The tiny model
cannot play gridsim (it ends its turn or calls unknown tools): the rewards do not matter here,
the shape of a rollout does.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class GenerateTimer:
    """ASGI middleware: the summed wall time of the ``/generate`` requests it served."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seconds = 0.0
        self.requests = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.seconds += time.perf_counter() - t0
            self.requests += 1


async def play_all(
    gateway: str, rows: list[Any], concurrency: int, progress: Progress, max_tokens: int
) -> tuple[list[Any], float]:
    from corral.gateway.client import GatewayAdmin
    from corral.rollouts.player import Player

    room = asyncio.Semaphore(concurrency)
    task = progress.add_task(f"concurrency {concurrency}", total=len(rows))
    async with GatewayAdmin(gateway) as admin:
        player = Player(admin, sampling={"temperature": 1.0, "max_tokens": max_tokens})

        async def one(row: Any) -> Any:
            async with room:
                out = await player.play(row)
            progress.advance(task)
            return out

        t0 = time.perf_counter()
        rollouts = await asyncio.gather(*(one(r) for r in rows))
        return rollouts, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    import torch

    from corral.engines.local.engine import LocalEngine
    from corral.engines.local.server import build_engine_app
    from corral.engines.tiny_model import cached_tiny_model
    from corral.envs.server import build_app
    from corral.gateway.server import create_gateway
    from corral.rollouts.rows import Row, RowSettings, write_rows
    from corral.serving import serve_in_thread

    torch.set_num_threads(1)
    console = Console(width=150)
    model = cached_tiny_model("qwen25")
    results = []
    with ExitStack() as stack:
        timer = GenerateTimer(build_engine_app(LocalEngine(model)))
        engine_url = stack.enter_context(serve_in_thread(timer))
        gateway = stack.enter_context(serve_in_thread(create_gateway(engine_url, model)))
        env_url = stack.enter_context(serve_in_thread(build_app(ROOT / "bundles" / "gridsim")))
        out = Path(".corral/bench/rollout-rows")
        write_rows(env_url, out, RowSettings(max_turns=args.max_turns))
        lines = (out / "train.jsonl").read_text().splitlines()[: args.rollouts]
        rows = [Row.model_validate_json(line) for line in lines]
        with Progress(console=console, transient=True) as progress:
            for concurrency in args.concurrency:
                before_s, before_n = timer.seconds, timer.requests
                rollouts, wall = asyncio.run(
                    play_all(gateway, rows, concurrency, progress, args.max_tokens)
                )
                engine_s = timer.seconds - before_s
                results.append((concurrency, rollouts, wall, engine_s, timer.requests - before_n))

    table = Table(title="gridsim rollouts through the player (shares of the summed rollout time)")
    for col in (
        "concurrency",
        "rollouts/s",
        "turns/rollout",
        "rollout p50",
        "engine",
        "gateway",
        "tools",
        "corral",
        "gateway + corral",
    ):
        table.add_column(col, justify="right")
    for concurrency, rollouts, wall, engine_s, _ in results:
        total = sum(r.timing.total_s for r in rollouts)
        model = sum(r.timing.model_s for r in rollouts)
        tools = sum(r.timing.tools_s for r in rollouts)
        failed = sum(r.failed for r in rollouts)
        assert not failed, [r.reason for r in rollouts if r.failed]
        gateway_s = max(0.0, model - engine_s)
        corral_s = max(0.0, total - model - tools)
        table.add_row(
            str(concurrency),
            f"{len(rollouts) / wall:.1f}",
            f"{statistics.fmean(r.turns for r in rollouts):.2f}",
            f"{1e3 * statistics.median(r.timing.total_s for r in rollouts):.0f} ms",
            f"{engine_s / total:.1%}",
            f"{gateway_s / total:.1%}",
            f"{tools / total:.1%}",
            f"{corral_s / total:.1%}",
            f"{(gateway_s + corral_s) / total:.1%}",
        )
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
