"""Worlds of several processes on CPU for the trainer's parallel tests: a free loopback port,
and a process joined as torchrun's environment would join it."""

from __future__ import annotations

import os
import socket

TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


def free_port() -> int:
    """A loopback port free now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_as_torchrun(rank: int, world: int, port: int) -> None:
    """Set this process's environment as torchrun sets a rank's (``megatron_cpu.setup`` reads
    it); :data:`TORCHRUN_VARS` names what to delete to leave that world's settings."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
