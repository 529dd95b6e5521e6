"""The shell protocol of the container backends (docker, kubernetes, e2b): how one exec, one
spawn and one session kill become command lines for a sandbox that the host reaches only
through its backend's transport (the docker API, the Kubernetes exec stream, E2B's envd).

The convention, the same on all three:

- Every command runs in a *session of its own* led by a wrapper shell, which first writes the
  session's id to the command's *sid file* (:func:`record_session`). The bookkeeping files of a
  command are ``<state_dir>/<tag>.sid`` and, when stdin travels as a file, ``<tag>.in``
  (:class:`SessionFiles`; ``state_dir`` is :data:`STATE_DIR` unless a backend says otherwise).
- Two timeouts. Inside, ``timeout --kill-after=1 T`` (:func:`timeout_cmd`) signals the
  command's process group: SIGTERM at ``T``, SIGKILL a second later. Outside, when the command
  has not ended :func:`host_deadline` seconds after it started, the host runs a second command,
  the *session kill* (:func:`kill_line`): it reads the sid file and SIGKILLs every process of
  the session, which also ends children that moved to a process group of their own. A process
  that leaves the session (``setsid``) escapes both and dies with the sandbox.
- A command *timed out* (:func:`timed_out`) when the host killed it, ``timeout`` reported 124,
  or it died of SIGKILL (137) no sooner than ``T``.
- A caller that is cancelled while it waits (or whose wait fails) gets the command's session
  killed before the cancellation propagates (:func:`wait_or_kill`): no command outlives the
  call that started it. The kill is shielded, so it finishes even then.

What differs is what each transport gives a command, so each has its own wrapper builders
(``docker_*``, ``k8s_*``, ``e2b_*``), all made of the pieces above.
"""

from __future__ import annotations

import asyncio
import shlex
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TypeVar

T = TypeVar("T")

STATE_DIR = "/tmp/.corral"  # the bookkeeping folder inside a sandbox (sid and stdin files)
KILL_AFTER_S = 1  # ``timeout --kill-after``: SIGKILL this long after the SIGTERM
HOST_GRACE_S = 3.0  # the session kill this long after the in-sandbox timeout should have fired
SPAWN_STARTED = b"corral-spawn-started"  # a spawn wrapper's line on stderr just before exec

# SIGKILL every process of session "$1" but the calling shell, twice (a process may fork while
# the first pass runs), for sandboxes without procps. Reads /proc directly; the fields after
# the command name's closing ")" are: state ppid pgrp session.
KILL_SESSION_FN = (
    "k() { for _ in 1 2; do for p in /proc/[0-9]*; do q=${p#/proc/}; "
    '[ "$q" = "$$" ] && continue; '
    '[ "$(sed \'s/.*) //\' "$p/stat" 2>/dev/null | cut -d\' \' -f4)" = "$1" ] '
    '&& kill -KILL "$q" 2>/dev/null; done; done; }'
)


# -- the bookkeeping files ---------------------------------------------------------------------


def new_tag() -> str:
    """A fresh name for one command's bookkeeping files."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True, slots=True)
class SessionFiles:
    """One command's bookkeeping files inside the sandbox: ``sid`` holds the id of the session
    its wrapper leads; ``stdin``, when not ``None``, the bytes for its stdin."""

    sid: str
    stdin: str | None = None

    @classmethod
    def new(cls, state_dir: str = STATE_DIR, *, stdin: bool = False) -> SessionFiles:
        """Fresh names under ``state_dir`` (nothing is created)."""
        base = f"{state_dir}/{new_tag()}"
        return cls(f"{base}.sid", f"{base}.in" if stdin else None)

    @property
    def paths(self) -> tuple[str, ...]:
        """Every file, the sid file first."""
        return (self.sid, self.stdin) if self.stdin else (self.sid,)


# -- the timeouts ------------------------------------------------------------------------------


def inner_timeout(timeout: float) -> float:
    """The in-sandbox timeout for a caller's ``timeout`` (``timeout`` needs one above 0)."""
    return max(float(timeout), 0.001)


def host_deadline(t: float) -> float:
    """How long the host waits for a command whose in-sandbox timeout is ``t`` before it kills
    the command's session: ``timeout``'s own SIGKILL, then :data:`HOST_GRACE_S`."""
    return t + KILL_AFTER_S + HOST_GRACE_S


def timed_out(exit_code: int, elapsed: float, t: float, *, host_killed: bool) -> bool:
    """Whether a command that ran ``elapsed`` seconds under in-sandbox timeout ``t`` and ended
    with ``exit_code`` timed out (see the module docstring)."""
    return host_killed or exit_code == 124 or (exit_code == 137 and elapsed >= t)


async def wait_or_kill(
    pending: asyncio.Future[T],
    *,
    deadline: float,
    kill: Callable[[], Awaitable[None]],
    kill_wait: float,
    drop: Callable[[], object],
    lost: T,
) -> tuple[T, bool]:
    """Wait for ``pending`` (a started command's outcome) under the host-side timeout; return
    its result and whether the host had to kill the command.

    Past ``deadline`` seconds ``kill()`` (the session kill) runs and ``pending`` gets
    ``kill_wait`` seconds more; then it is dropped (``drop()``: stop waiting, release the
    transport) and ``lost`` stands for its result. When the caller is cancelled or ``pending``
    fails, the command is dropped and killed and the exception propagates; the kill is
    shielded, so it finishes even then. ``kill`` never raises but for its own cancellation."""
    try:
        try:
            return await asyncio.wait_for(asyncio.shield(pending), deadline), False
        except TimeoutError:
            await kill()
            try:
                return await asyncio.wait_for(asyncio.shield(pending), kill_wait), True
            except TimeoutError:
                drop()
                return lost, True
    except BaseException:
        drop()
        await asyncio.shield(asyncio.ensure_future(kill()))
        raise


# -- the pieces of every wrapper ---------------------------------------------------------------


def timeout_cmd(t: float) -> str:
    """Shell that runs the wrapper's arguments (``"$@"``) under the in-sandbox timeout ``t``."""
    return f'timeout --kill-after={KILL_AFTER_S} {t:.3f} "$@"'


def record_session(sid_file: str, *, leader: bool = True, mode: str | None = None) -> str:
    """Shell that writes the wrapper's session id to ``sid_file``, its folder made first (with
    ``mode`` when given) on every run, since the sandbox's user may remove it. ``leader``: the
    wrapper leads its session (``setsid`` started it), so the id is its pid; otherwise ``ps``
    (procps) is asked. Failures are silent: the command runs anyway, unkillable from outside."""
    folder = shlex.quote(str(PurePosixPath(sid_file).parent))
    mkdir = f"mkdir -p -m {mode} {folder}" if mode else f"mkdir -p {folder}"
    sid = "echo $$" if leader else "ps -o sid= -p $$"
    return f"{{ {mkdir} && {sid} > {shlex.quote(sid_file)}; }} 2>/dev/null; "


def kill_line(sid_file: str, *remove: str, procps: bool = True, as_uids: Sequence[int] = ()) -> str:
    """Shell that SIGKILLs every process of the session named in ``sid_file``, then removes the
    files ``remove``; a missing sid file is fine, and it always exits 0. ``procps``: with
    ``pkill``; otherwise the session's process group first, then a scan of ``/proc``
    (:data:`KILL_SESSION_FN`). ``as_uids`` (with ``procps``): ``pkill`` runs once as each of
    these uids, in order, through ``setpriv`` (the caller may change uid but lacks
    ``CAP_KILL``, so it can signal only processes of its own uid)."""
    sid = shlex.quote(sid_file)
    rm = f"rm -f {' '.join(shlex.quote(f) for f in remove)}; " if remove else ""
    if procps:
        # $s unquoted: ``ps -o sid=`` pads the id with blanks.
        pkill = "pkill -KILL -s $s"
        if as_uids:
            pkill = "; ".join(
                f"setpriv --reuid={u} --regid={u} --clear-groups -- {pkill}" for u in as_uids
            )
            pkill = f"{{ {pkill}; }}"
        return f"s=$(cat {sid} 2>/dev/null) && {pkill}; {rm}true"
    return (
        f"{KILL_SESSION_FN}; s=$(cat {sid} 2>/dev/null); "
        f'if [ -n "$s" ]; then kill -KILL -- "-$s" 2>/dev/null; k "$s"; fi; {rm}true'
    )


def env_args(env: Mapping[str, str] | None) -> list[str]:
    """``env -- K=V ...``: re-applies ``env`` to the command after a shell that may reset some
    of it. ``ValueError`` for a name or value that ``env`` would misread."""
    pairs = []
    for k, v in (env or {}).items():
        if not k or "=" in k or "\0" in k + v:
            raise ValueError(f"invalid environment variable name or value: {k!r}")
        pairs.append(f"{k}={v}")
    return ["env", "--", *pairs]


# -- docker: the exec leads a session of its own, and the API sets env and cwd ----------------


def docker_exec_argv(cmd: Sequence[str], files: SessionFiles, t: float) -> list[str]:
    """The argv of one exec: the wrapper records its session and becomes ``timeout``, reading
    ``files.stdin`` when there is one (the host removes the files afterwards)."""
    redirect = f" < {shlex.quote(files.stdin)}" if files.stdin else ""
    script = record_session(files.sid, leader=False) + f"exec {timeout_cmd(t)}{redirect}"
    return ["sh", "-c", script, "sh", *cmd]


def docker_spawn_argv(cmd: Sequence[str], sid_file: str, prefix: Sequence[str]) -> list[str]:
    """The argv of a spawn: the wrapper records its session in a folder only its user may
    read, then becomes ``prefix`` + ``cmd``."""
    script = record_session(sid_file, leader=False, mode="700") + f'exec {shlex.join(prefix)} "$@"'
    return ["sh", "-c", script, "sh", *cmd]


# -- kubernetes: an argv on an exec stream, nothing else ---------------------------------------


def _check_cmd(cmd: Sequence[str]) -> None:
    if not cmd:
        raise ValueError("exec needs a command")
    if "=" in cmd[0]:
        raise ValueError(
            f"a command name cannot hold '=' (env would read it as a variable): {cmd[0]!r}"
        )


def _forget_if_alone(sid_file: str) -> str:
    """Shell that removes the sid file once the wrapper is the last of its session; a
    background process that stays keeps it (the host-side session kill still finds it)."""
    return f'[ "$(pgrep -s $$)" = "$$" ] && rm -f {shlex.quote(sid_file)}'


def k8s_exec_argv(
    cmd: Sequence[str],
    files: SessionFiles,
    *,
    env: Mapping[str, str] | None,
    cwd: str,
    t: float,
    stdin_len: int | None,
) -> list[str]:
    """The argv that runs ``cmd`` under the in-sandbox timeout in a session of its own
    (``setsid``); the wrapper stays (it reports a killed command as 128 + signal) and at the
    end removes its sid file unless something else still runs in the session. ``stdin_len``:
    feed exactly that many bytes of the stream's stdin to the command, then end of file
    (``None``: stdin is ``/dev/null``). A missing ``cwd`` is exit code 126."""
    _check_cmd(cmd)
    run = timeout_cmd(t)
    run = f"head -c {stdin_len} | {run}" if stdin_len is not None else f"{run} < /dev/null"
    script = (
        record_session(files.sid)
        + f"cd -- {shlex.quote(cwd)} || exit 126; "
        + f"{run}; rc=$?; {_forget_if_alone(files.sid)}; exit $rc"
    )
    return ["setsid", "-w", "sh", "-c", script, "sh", *env_args(env), *cmd]


def k8s_spawn_argv(
    cmd: Sequence[str], files: SessionFiles, *, env: Mapping[str, str] | None, cwd: str
) -> list[str]:
    """The argv that starts ``cmd`` in a session of its own; the wrapper writes
    :data:`SPAWN_STARTED` and a newline to stderr just before it execs ``cmd`` (so that the
    host knows it started)."""
    _check_cmd(cmd)
    script = (
        record_session(files.sid)
        + f"cd -- {shlex.quote(cwd)} || exit 126; "
        + f"printf '%s\\n' {SPAWN_STARTED.decode()} >&2; exec \"$@\""
    )
    return ["setsid", "-w", "sh", "-c", script, "sh", *env_args(env), *cmd]


# -- e2b: one command line under envd's ``bash -l -c``, which sets cwd (env: see env_args) ----


def _login_line(cmd: Sequence[str], script: str, env: Mapping[str, str]) -> str:
    prefix = shlex.join(env_args(env)) + " " if env else ""
    return f"exec {prefix}setsid -w sh -c {shlex.quote(script)} sh {shlex.join(cmd)}"


def e2b_exec_line(
    cmd: Sequence[str], files: SessionFiles, *, env: Mapping[str, str], t: float
) -> str:
    """The command line for one exec: a new session; on a timeout (124, or 137 after the
    SIGKILL) the wrapper kills everything else in the session itself; the files are removed
    at the end (the host-side kill removes them when the wrapper cannot)."""
    redirect = shlex.quote(files.stdin) if files.stdin else "/dev/null"
    script = (
        f"{KILL_SESSION_FN}; {record_session(files.sid)}"
        f"{timeout_cmd(t)} < {redirect}; s=$?; "
        f"if [ $s -eq 124 ] || [ $s -eq 137 ]; then k $$; fi; "
        f"rm -f {' '.join(shlex.quote(f) for f in files.paths)}; exit $s"
    )
    return _login_line(cmd, script, env)


def e2b_spawn_line(cmd: Sequence[str], files: SessionFiles, *, env: Mapping[str, str]) -> str:
    """The command line for a spawned process: a shell leading a new session runs ``cmd`` with
    envd's stdin and stdout pipes; when ``cmd`` ends (by itself or killed) the shell SIGKILLs
    what is left in the session, then removes the sid file. (Without that, what a spawned
    process started would outlive it until the sandbox ends: once the file is gone the
    host-side kill finds no session to kill.)"""
    q = shlex.quote(files.sid)
    script = f'{KILL_SESSION_FN}; {record_session(files.sid)}"$@"; s=$?; k $$; rm -f {q}; exit $s'
    return _login_line(cmd, script, env)
