"""Run one shell command for the ``bash`` tool: a time limit, bounded output, nothing left over.

:func:`run_command` starts ``bash -c COMMAND`` in a new session (so in a process group of its
own, whose id is bash's pid), reads stdout and stderr as they come, keeping the first
``limit_bytes`` of each and counting the rest, and then:

- when bash exits within ``timeout_s``: kills whatever it left running in its group
  (background jobs do not outlive the call), reaps bash and returns its exit status;
- when it does not: kills the whole group with SIGKILL, reaps bash and reports a timeout.

The group is killed *before* bash is reaped: until then bash's pid, which is the group's id,
cannot be reused, so the kill can only reach the command's own processes. A process that left
the group (``setsid``) escapes the kill; if it still holds the output pipes, reading stops
``grace_s`` after bash is gone, so the call returns anyway. The sandbox's own teardown is what
ends such processes.

Orphans: the processes bash leaves behind are re-parented to the nearest subreaper or pid 1.
Inside a sandbox that is often the env's own process (bwrap runs the runner as its namespace's
pid 1), where nothing else reaps them: killed, they would stay zombies and eat the sandbox's
pids limit call after call. :func:`reap_group` reaps this process's exited children in one
group and nothing else (``waitid(P_PGID)``), so it never steals another child's exit status;
run it for every earlier group now and then to catch the ones re-parented late.

Output goes through pipes, not files: a command that floods its output for the whole time
limit costs CPU but no disk and no memory beyond ``limit_bytes``.

The command line is :func:`~corral.envs.model_actions.model_argv` of ``bash -c COMMAND``: in a
sandbox, the backend's jail prefix puts the model's command out of the runner's reach. The
command reads nothing of the runner: its stdin is ``/dev/null`` and no descriptor of the runner
but the two output pipes is inherited (``close_fds``).

Standard library only (and corral's ``model_actions``, shipped beside the runner): this runs
inside the sandbox.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from corral.envs.model_actions import model_argv

# How often to look for bash's exit where no pidfd can announce it (old kernels, seccomp).
_POLL_S = 0.01
_CHUNK = 65536


@dataclass(frozen=True)
class Captured:
    """One output stream: its first bytes (``data``) and how many it produced in all."""

    data: bytes
    total: int

    @property
    def truncated(self) -> bool:
        return self.total > len(self.data)


@dataclass(frozen=True)
class CommandResult:
    """How a command ended. ``exit_code`` is bash's status (negative: killed by that signal)
    and None when it timed out."""

    exit_code: int | None
    timed_out: bool
    stdout: Captured
    stderr: Captured
    seconds: float
    group: int  # the process group the command ran in (for :func:`reap_group`)


class _Sink:
    """Keeps the first ``limit`` bytes of a stream and counts all of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    def captured(self) -> Captured:
        return Captured(bytes(self.data), self.total)


def run_command(
    command: str,
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout_s: float,
    limit_bytes: int,
    grace_s: float = 0.5,
) -> CommandResult:
    """Run ``bash -c command`` in ``cwd`` with exactly ``env`` (see the module docstring).

    Raises OSError only when bash cannot be started at all (not installed: an image bug).
    """
    start = time.monotonic()
    proc = subprocess.Popen(
        model_argv(["bash", "-c", command]),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,  # the runner's protocol pipes and files stay the runner's
    )
    assert proc.stdout is not None and proc.stderr is not None
    sinks = {proc.stdout: _Sink(limit_bytes), proc.stderr: _Sink(limit_bytes)}
    exited = False
    try:
        with selectors.DefaultSelector() as selector:
            for stream in sinks:
                os.set_blocking(stream.fileno(), False)
                selector.register(stream, selectors.EVENT_READ)
            exited = _read_until_exit(proc.pid, selector, sinks, start + timeout_s)
            _kill_group(proc.pid)
            proc.wait()
            reap_group(proc.pid)
            _drain(selector, sinks, time.monotonic() + grace_s)
    finally:
        if proc.returncode is None:  # an exception above: never leave the group behind
            _kill_group(proc.pid)
            proc.wait()
        for stream in sinks:
            stream.close()
    return CommandResult(
        exit_code=proc.returncode if exited else None,
        timed_out=not exited,
        stdout=sinks[proc.stdout].captured(),
        stderr=sinks[proc.stderr].captured(),
        seconds=time.monotonic() - start,
        group=proc.pid,
    )


def reap_group(pgid: int) -> int:
    """Reap this process's exited children in process group ``pgid`` (orphans it adopted, see
    the module docstring) without blocking; returns how many it reaped."""
    reaped = 0
    while True:
        try:
            info = os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG)
        except ChildProcessError:  # no child (left) in that group
            return reaped
        if info is None:  # children in the group, none exited yet
            return reaped
        reaped += 1


def _read_until_exit(
    pid: int, selector: selectors.BaseSelector, sinks: dict[IO[bytes], _Sink], deadline: float
) -> bool:
    """Read output until bash exits (True) or ``deadline`` passes (False); bash stays
    unreaped either way."""
    pidfd = _pidfd(pid)
    if pidfd is not None:
        selector.register(pidfd, selectors.EVENT_READ)
    try:
        while not _has_exited(pid):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            wait = remaining if pidfd is not None else min(remaining, _POLL_S)
            for key, _ in selector.select(wait):
                if key.fileobj is not pidfd:
                    _read_some(selector, key.fileobj, sinks)  # type: ignore[arg-type]
        return True
    finally:
        if pidfd is not None:
            selector.unregister(pidfd)
            os.close(pidfd)


def _drain(
    selector: selectors.BaseSelector, sinks: dict[IO[bytes], _Sink], deadline: float
) -> None:
    """Read what is left in the pipes until both are at end of file or ``deadline`` passes
    (a process that escaped the group may hold them open)."""
    while selector.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        for key, _ in selector.select(remaining):
            _read_some(selector, key.fileobj, sinks)  # type: ignore[arg-type]


def _read_some(
    selector: selectors.BaseSelector, stream: IO[bytes], sinks: dict[IO[bytes], _Sink]
) -> None:
    """One read from a ready pipe; at end of file, stop watching it."""
    try:
        chunk = os.read(stream.fileno(), _CHUNK)
    except BlockingIOError:
        return
    if chunk:
        sinks[stream].add(chunk)
    else:
        selector.unregister(stream)


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (readable once it exits), or None where the system has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _has_exited(pid: int) -> bool:
    """Whether bash has exited, without reaping it (WNOWAIT keeps its pid reserved)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere; nothing left to wait for
        return True
    return info is not None


def _kill_group(pgid: int) -> None:
    """SIGKILL every process in the group; an empty group is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
