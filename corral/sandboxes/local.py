"""The ``local`` backend: a plain subprocess in a temporary folder.

**NO ISOLATION. FOR DEVELOPMENT ONLY.** Commands run as the server's own user, with its
network, its view of every file and process on the host, and no resource limits. The sandbox's
``workdir`` is only a *name* mapped to a temporary folder; nothing stops a command from leaving
it. Never run untrusted model actions with this backend: use ``bwrap`` or ``docker``.

Model actions (:meth:`LocalProvider.model_jail`): when the server runs as root, each model
command runs through ``setpriv`` as an unprivileged uid (:data:`NOBODY` unless the provider is
given another), and the sandbox's folder is that uid's: it then cannot signal or trace the
runner, read its memory, environment or file descriptors (root's, and non-dumpable), nor read
root's private files. It still sees every process and every world-readable file of the host
(the bundle's own grading code included) and the host's network. When the server is not root
there is no other uid to switch to and the jail is empty: the model's commands run as the
runner's own uid and can signal it (its memory stays closed: the runner is non-dumpable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from corral.sandboxes.base import (
    MAX_LINE,
    STDERR_TAIL,
    Endpoint,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxProcess,
    SandboxProvider,
    SandboxSpec,
    setpriv_jail,
)
from corral.sandboxes.records import Record, RecordStore

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path(tempfile.gettempdir()) / "corral-sandboxes"
NOBODY = 65534  # the model's uid (and gid) when the server runs as root
# After a kill, how long to wait for the pipes to drain: a grandchild that left the process
# group may hold them open, and it must not hang exec.
_DRAIN_S = 1.0


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """What :func:`run_tree` saw: exit code (negative signal number if killed), output."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool


async def run_tree(
    argv: Sequence[str],
    *,
    timeout: float,  # noqa: ASYNC109 -- kills the process group, not just this await
    env: Mapping[str, str],
    cwd: str | Path,
    stdin: bytes | None,
    running: set[int],
    pass_fds: tuple[int, ...] = (),
) -> RunOutcome:
    """Run ``argv`` as the leader of a new session; on timeout (or cancellation) SIGKILL the
    whole process group. The leader's pid is in ``running`` while it runs (so a close can kill
    it). Raises ``OSError`` if ``argv`` cannot be started."""
    proc = await start_session(
        argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(env),
        cwd=cwd,
        pass_fds=pass_fds,
    )  # its own session and process group: one killpg reaches the whole tree
    running.add(proc.pid)
    comm = asyncio.ensure_future(proc.communicate(stdin))
    timed_out = False
    try:
        try:
            out, err = await asyncio.wait_for(asyncio.shield(comm), timeout)
        except TimeoutError:
            timed_out = True
            kill_group(proc.pid)
            try:
                out, err = await asyncio.wait_for(asyncio.shield(comm), _DRAIN_S)
            except TimeoutError:
                comm.cancel()
                out, err = b"", b""
                await proc.wait()
    except asyncio.CancelledError:
        kill_group(proc.pid)
        comm.cancel()
        raise
    finally:
        running.discard(proc.pid)
    rc = proc.returncode
    return RunOutcome(rc if rc is not None else -9, out, err, timed_out)


async def start_session(argv: Sequence[str], **kw: Any) -> asyncio.subprocess.Process:
    """``create_subprocess_exec(*argv, start_new_session=True, **kw)`` that a cancellation
    cannot orphan: a caller cancelled while the process starts (it may already run) waits for
    the start to finish, since the descriptors it passes stay in use until then, gets the new
    process group killed, and re-raises. ``OSError`` if ``argv`` cannot be started."""
    starting = asyncio.ensure_future(
        asyncio.create_subprocess_exec(*argv, start_new_session=True, **kw)
    )
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        starting.add_done_callback(_kill_started)
        with contextlib.suppress(Exception):  # OSError: it never started
            await asyncio.shield(starting)
        raise


def _kill_started(starting: asyncio.Future[asyncio.subprocess.Process]) -> None:
    if not starting.cancelled() and starting.exception() is None:
        kill_group(starting.result().pid)


def kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid``; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class PipeProcess(SandboxProcess):
    """A :class:`SandboxProcess` that is a host subprocess (local, bwrap): the leader of a
    session of its own, so :meth:`kill` reaches its whole process group."""

    def __init__(self, proc: asyncio.subprocess.Process, running: set[int]) -> None:
        self._proc = proc
        self._running = running
        self._tail = bytearray()
        running.add(proc.pid)
        self._drain = asyncio.ensure_future(self._drain_stderr())

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | Path,
        running: set[int],
        pass_fds: tuple[int, ...] = (),
    ) -> PipeProcess:
        """Start ``argv`` with piped stdio; ``OSError`` if it cannot be started."""
        proc = await start_session(
            argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env),
            cwd=cwd,
            pass_fds=pass_fds,
            limit=MAX_LINE,
        )
        return cls(proc, running)

    async def _drain_stderr(self) -> None:
        assert self._proc.stderr is not None
        while chunk := await self._proc.stderr.read(65536):
            self._tail += chunk
            del self._tail[:-STDERR_TAIL]

    async def write(self, data: bytes) -> None:
        stdin = self._proc.stdin
        if stdin is None or self._proc.returncode is not None or stdin.is_closing():
            raise SandboxError("the process has exited")
        try:
            stdin.write(data)
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise SandboxError(f"the process has exited: {e}") from e

    async def readline(self) -> bytes:
        assert self._proc.stdout is not None
        try:
            return await self._proc.stdout.readline()
        except ValueError as e:  # asyncio's "separator not found, chunk exceeds the limit"
            raise SandboxError(f"a line of output is over {MAX_LINE} bytes") from e

    async def _kill(self) -> None:
        """SIGKILL the process group, reap the leader, let stderr drain a moment."""
        kill_group(self._proc.pid)
        self._running.discard(self._proc.pid)
        # asyncio's wait() also waits for the pipes to close, and stderr drains until then: a
        # grandchild that left the group may hold them open, and is not waited for long.
        waiting = {asyncio.ensure_future(self._proc.wait()), self._drain}
        _, late = await asyncio.wait(waiting, timeout=_DRAIN_S)
        for fut in late:
            fut.cancel()

    def stderr_tail(self) -> str:
        return self._tail.decode(errors="replace")


class HostFolderFiles:
    """``write_file``/``read_file`` and ``is_alive`` for sandboxes whose workdir is a folder on
    the host (local, bwrap): files go straight to the folder, never through an exec, and the
    sandbox lives as long as the folder."""

    id: str
    folder: Path
    spec: SandboxSpec
    _closing: asyncio.Task[None] | None

    async def is_alive(self) -> bool:
        """Whether the sandbox is open and its folder exists. Never raises: a folder that
        cannot be looked at is "not alive" (logged, with the error)."""
        try:
            return self._closing is None and self.folder.is_dir()
        except Exception as e:
            log.warning("sandbox %s: cannot look at %s: %s", self.id, self.folder, e)
            return False

    def host_path(self, path: str) -> Path:
        """The host path for ``path`` (absolute under ``workdir``, or relative to it).
        Raises :class:`SandboxError` for a path that escapes the folder, symlinks the sandbox
        may have planted included (the path is resolved before the check)."""
        p = PurePosixPath(path)
        if p.is_absolute():
            try:
                p = p.relative_to(self.spec.workdir)
            except ValueError:
                raise SandboxError(f"{path!r} is outside the workdir {self.spec.workdir}") from None
        full = (self.folder / p).resolve()
        if not full.is_relative_to(self.folder.resolve()):
            raise SandboxError(f"{path!r} escapes the sandbox workdir")
        return full

    async def write_file(self, path: str, data: bytes) -> None:
        """Write under the workdir (parents created); :class:`SandboxError` for other paths."""
        target = self.host_path(path)
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)

    async def read_file(self, path: str) -> bytes:
        """Read under the workdir; :class:`SandboxError` if missing or outside it."""
        try:
            return await asyncio.to_thread(self.host_path(path).read_bytes)
        except OSError as e:
            raise SandboxError(f"cannot read {path!r} in {self.id}: {e}") from e


class LocalSandbox(HostFolderFiles, Sandbox):
    """A temporary folder standing in for ``spec.workdir``. **NO ISOLATION** (module doc):
    commands run on the host as the server's user; this is for development only."""

    def __init__(self, id: str, folder: Path, spec: SandboxSpec, on_close: RecordStore) -> None:
        self.id = id
        self.folder = folder
        self.spec = spec
        self._records = on_close
        self._running: set[int] = set()

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        """The command's environment: the host's PATH, HOME the folder, the spec's, ``env``."""
        full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.folder)}
        return full | dict(self.spec.env) | dict(env or {})

    async def exec(
        self,
        cmd: Sequence[str],
        *,
        timeout: float,  # noqa: ASYNC109
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` on the host in the folder. Raises :class:`SandboxError` once closed or
        when ``cmd`` cannot be started."""
        if self._closing is not None or not self.folder.is_dir():
            raise SandboxError(f"sandbox {self.id} is closed")
        full_env = self._env(env)
        try:
            out = await run_tree(
                cmd,
                timeout=timeout,
                env=full_env,
                cwd=self.host_path(cwd or self.spec.workdir),
                stdin=stdin,
                running=self._running,
            )
        except OSError as e:
            return ExecResult(127, "", f"cannot start {cmd[0]!r}: {e}")
        return ExecResult(
            out.exit_code, out.stdout.decode(errors="replace"), out.stderr.decode(errors="replace"),
            timed_out=out.timed_out,
        )  # fmt: skip

    async def spawn(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> SandboxProcess:
        """Start ``cmd`` on the host in the folder (no isolation). :class:`SandboxError` once
        closed or when it cannot be started."""
        if self._closing is not None or not self.folder.is_dir():
            raise SandboxError(f"sandbox {self.id} is closed")
        full_env = self._env(env)
        try:
            return await PipeProcess.start(
                cmd,
                env=full_env,
                cwd=self.host_path(cwd or self.spec.workdir),
                running=self._running,
            )
        except OSError as e:
            raise SandboxError(f"cannot start {cmd[0]!r} in {self.id}: {e}") from e

    async def endpoint(self, port: int) -> Endpoint:
        """The host's loopback: a local sandbox shares the host network."""
        return Endpoint("127.0.0.1", port)

    async def _close(self) -> None:
        for pgid in list(self._running):
            kill_group(pgid)
        await asyncio.to_thread(shutil.rmtree, self.folder, True)
        self._records.remove(self.id)


def _is_dir(path: str) -> bool:
    return os.path.isdir(path)


class LocalProvider(SandboxProvider):
    """Creates :class:`LocalSandbox` es. **NO ISOLATION** (see the module docstring)."""

    name = "local"
    host_binds = False  # nothing is mounted: commands see the host's own paths
    isolated = False

    def __init__(
        self,
        owner: str,
        state_dir: Path | None = None,
        *,
        model_uid: int | Literal["auto"] | None = "auto",
    ) -> None:
        """``model_uid``: the uid model actions run as; ``"auto"``: :data:`NOBODY` when this
        process is root, else ``None`` (the server's own uid: no jail, see the module doc)."""
        self.owner = owner
        self.records = RecordStore(state_dir or DEFAULT_STATE_DIR, self.name)
        if model_uid == "auto":
            model_uid = NOBODY if os.geteuid() == 0 else None
        self.model_uid = model_uid

    def model_jail(self, spec: SandboxSpec) -> tuple[str, ...]:
        """``setpriv`` to :attr:`model_uid`, or nothing when there is none (module doc).
        :class:`SandboxError` when there is one but no ``setpriv`` (util-linux) on the host:
        running the model as root instead would be the wrong failure."""
        if self.model_uid is None:
            return ()
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise SandboxError("the local backend as root needs setpriv (util-linux)")
        return setpriv_jail(self.model_uid, setpcap=True, setpriv=setpriv)

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        """A new temporary folder, recorded first. :class:`SandboxError` if it cannot be made
        (the record is removed again)."""
        sid = f"lo-{uuid.uuid4().hex[:12]}"
        folder = self.records.root / sid
        try:
            self.records.write(
                Record.mine(sid, self.name, self.owner, spec.ttl_s, folder=str(folder))
            )
            folder.mkdir(parents=True)
            if self.model_uid is not None:  # the model's work folder is the model's
                os.chown(folder, self.model_uid, self.model_uid)
        except OSError as e:
            shutil.rmtree(folder, ignore_errors=True)
            self.records.remove(sid)
            raise SandboxError(f"cannot create local sandbox: {e}") from e
        return LocalSandbox(sid, folder, spec, self.records)

    async def list_owned(self) -> list[str]:
        # Records are a few small files: reading them inline is cheaper than a thread hop.
        owned = self.records.owned(self.owner)
        return [r.id for r in owned if _is_dir(r.extra["folder"])]

    async def sweep(self) -> list[str]:
        """Remove folders whose owner died or whose ttl passed. Processes they started are not
        tracked across a crash (no isolation): only the folder and record go."""
        gone = []
        for r in self.records.stale():
            await asyncio.to_thread(shutil.rmtree, r.extra.get("folder", ""), True)
            self.records.remove(r.id)
            gone.append(r.id)
        return gone
