"""Reading and removing cgroups (v1 files), shared by the backends that account limits."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def event_count(text: str, key: str) -> int:
    """The sum of ``key N`` lines in ``text`` (the contents of one or more cgroup event or
    control files, e.g. ``oom_kill 1`` in ``memory.oom_control``, ``max 3`` in
    ``pids.events``); lines of any other shape are ignored."""
    total = 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            total += int(parts[1])
    return total


def read_counter(path: Path, key: str) -> int:
    """Counter ``key`` of the cgroup file ``path`` (0 when it cannot be read)."""
    try:
        return event_count(path.read_text(), key)
    except OSError:
        return 0


def remove_cgroup(path: Path) -> None:
    """Kill what is left in cgroup ``path`` and remove it; a missing one is fine."""
    for _ in range(50):  # a fork bomb may fork between the read and the kill: retry
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY until the killed tasks are reaped
            time.sleep(0.01)
