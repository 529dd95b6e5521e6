"""Host processes seen through /proc, for tests that kill a sandbox from outside."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def kill_processes_in(folder: Path) -> int:
    """SIGKILL every process whose working folder is ``folder`` or below it (what an operator's
    ``kill -9`` of a sandbox's processes does); return how many were killed."""
    killed = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(folder):
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return killed


def kill_processes_of_cgroup(procs: Path) -> int:
    """SIGKILL every process listed in a cgroup's ``cgroup.procs``; return how many were killed.

    For a bwrap sandbox this reaches the runner too: the runner is non-dumpable, so its
    ``/proc/<pid>/cwd`` cannot be read from outside and :func:`kill_processes_in` misses it."""
    killed = 0
    for pid in procs.read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
        except ProcessLookupError:  # gone meanwhile
            pass
    return killed
