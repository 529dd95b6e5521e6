"""Who owns a sandbox, in labels every labelled backend (docker, kubernetes, e2b) shares.

A sandbox is labelled, atomically with its create call, with its owner process's host, boot
id, pid and that pid's start time, and with its expiry time. A later server's sweep can then
tell a sandbox whose owner is provably gone (same host, and a reboot since or that pid no
longer running with that start time) from one whose owner is alive or on another host, which
it never touches.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

from corral.sandboxes.records import process_start_time

HOST_LABEL = "corral.host"
BOOT_LABEL = "corral.boot_id"
PID_LABEL = "corral.owner_pid"
START_LABEL = "corral.owner_start"
EXPIRES_LABEL = "corral.expires"


def boot_id() -> str:
    """This host's boot id (changes at every reboot); ``"unknown"`` where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def owner_labels(ttl_s: float | None, now: float | None = None) -> dict[str, str]:
    """This process's liveness labels, plus the expiry time when there is a ``ttl_s``."""
    pid = os.getpid()
    start = process_start_time(pid)
    labels = {
        HOST_LABEL: socket.gethostname(),
        BOOT_LABEL: boot_id(),
        PID_LABEL: str(pid),
        START_LABEL: "" if start is None else str(start),
    }
    if ttl_s is not None:
        labels[EXPIRES_LABEL] = f"{(time.time() if now is None else now) + ttl_s:.3f}"
    return labels


def owner_gone(labels: Mapping[str, str]) -> bool:
    """Whether the labelled owner process is provably gone: same host, and either the host
    rebooted or that pid no longer runs with that start time. An owner on another host, or
    labels this host cannot read, are never provably gone (``False``)."""
    if labels.get(HOST_LABEL) != socket.gethostname():
        return False
    if labels.get(BOOT_LABEL) != boot_id():
        return True
    try:
        pid = int(labels.get(PID_LABEL, ""))
    except ValueError:
        return False
    start = process_start_time(pid)
    return start is None or str(start) != labels.get(START_LABEL)


def expired(labels: Mapping[str, str], now: float) -> bool:
    """Whether the ``corral.expires`` label is in the past (never, without a valid one)."""
    try:
        return float(labels.get(EXPIRES_LABEL, "inf")) < now
    except ValueError:
        return False
