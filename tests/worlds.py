"""Worlds of several processes on CPU for the trainer's parallel tests: spawning one and
waiting for it within a time limit, and a process joined as torchrun's environment would join
it. (A free port: ``tests.servers.free_port``.)"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest

TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


def spawn_world(
    worker: Callable[..., None], args: tuple[Any, ...], world: int, timeout_s: float
) -> None:
    """Run ``worker(rank, *args)`` in ``world`` spawned processes and wait for them all. A
    worker's exception fails the caller (torch re-raises it); a world still running after
    ``timeout_s`` is killed and fails the test."""
    import torch.multiprocessing as mp

    started = time.monotonic()
    context = mp.spawn(worker, args=args, nprocs=world, join=False)
    while not context.join(timeout=1):
        if time.monotonic() - started > timeout_s:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world} processes did not finish in {timeout_s} s")


def join_as_torchrun(rank: int, world: int, port: int) -> None:
    """Set this process's environment as torchrun sets a rank's (``megatron_runtime.setup`` reads
    it); :data:`TORCHRUN_VARS` names what to delete to leave that world's settings."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
