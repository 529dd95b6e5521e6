"""Crash-safe ownership records shared by the process-based backends (local, bwrap).

Contract: a provider writes a :class:`Record` (id, owner label, owner pid + the pid's start
time, created_at, ttl) into its state folder *before* it creates anything, and removes it only
after the sandbox is gone. A server that crashes between the two leaves the record behind; the
next server's :func:`stale_records` finds it (owner process gone, or ttl passed) and the
backend's ``sweep`` removes the sandbox and then the record. The owner's start time (from
``/proc/<pid>/stat``) guards against pid reuse: a recycled pid does not keep a record alive.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_SUFFIX = ".json"


def process_start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of ``pid``, or ``None`` if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True, slots=True)
class Record:
    """One sandbox's ownership record. ``extra``: backend data needed to remove it later."""

    id: str
    backend: str
    owner: str
    owner_pid: int
    owner_start: int | None
    created_at: float
    ttl_s: float | None
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def mine(cls, id: str, backend: str, owner: str, ttl_s: float | None, **extra: str) -> Record:
        """A record owned by this process, created now."""
        pid = os.getpid()
        return cls(id, backend, owner, pid, process_start_time(pid), time.time(), ttl_s, extra)

    def owner_alive(self) -> bool:
        """Whether the owning process still runs (same pid *and* same start time)."""
        start = process_start_time(self.owner_pid)
        return start is not None and (self.owner_start is None or start == self.owner_start)

    def expired(self, now: float | None = None) -> bool:
        """Whether the time to live has passed (never, when ``ttl_s`` is ``None``)."""
        now = time.time() if now is None else now
        return self.ttl_s is not None and now > self.created_at + self.ttl_s


class RecordStore:
    """Records of one backend in a state folder (created on first use), one file per id."""

    def __init__(self, root: Path, backend: str) -> None:
        self.root = root / backend
        self.backend = backend

    def write(self, record: Record) -> None:
        """Durably write ``record`` (temp file, fsync, rename): after a crash it is either
        complete or absent, never half-written. Raises ``OSError`` if the folder is unusable."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{record.id}{_SUFFIX}"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(asdict(record), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def remove(self, id: str) -> None:
        """Forget ``id``; a missing record is fine (idempotent)."""
        (self.root / f"{id}{_SUFFIX}").unlink(missing_ok=True)

    def all(self) -> list[Record]:
        """Every readable record; unreadable files (e.g. foreign) are skipped, not fatal."""
        out: list[Record] = []
        if not self.root.is_dir():
            return out
        for path in sorted(self.root.glob(f"*{_SUFFIX}")):
            try:
                out.append(Record(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return out

    def owned(self, owner: str) -> list[Record]:
        """Records of ``owner`` whose owning process is alive."""
        return [r for r in self.all() if r.owner == owner and r.owner_alive()]

    def stale(self, now: float | None = None) -> list[Record]:
        """Records to sweep: their owner process is gone, or their time to live passed."""
        return [r for r in self.all() if not r.owner_alive() or r.expired(now)]
