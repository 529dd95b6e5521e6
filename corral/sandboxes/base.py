"""The sandbox interface every backend implements (local, bwrap, docker, kubernetes, e2b).

A :class:`SandboxProvider` creates :class:`Sandbox` es from a :class:`SandboxSpec`. Untrusted
model actions run inside; the env server reaches services in a sandbox through
:meth:`Sandbox.endpoint`. Ownership: every sandbox a provider creates carries the provider's
``owner`` label and is recorded *before* it is created, so a crash between "create requested"
and "create answered" leaves a record that :meth:`SandboxProvider.sweep` finds and removes.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

OWNER_LABEL = "corral.owner"
# Where the env server puts the env runner's code in a sandbox that mounts host folders:
# the model jails of bwrap and docker keep it out of the model's sight (and reach).
RUNNER_ROOT = "/opt/corral"


def setpriv_jail(uid: int, *, setpcap: bool, setpriv: str = "setpriv") -> tuple[str, ...]:
    """The prefix that runs a command as ``uid`` (gid the same) from a privileged runner:
    no supplementary groups, no inheritable capabilities, ``no_new_privs`` (no setuid binary
    or file capability gives anything back). The uid change itself clears the permitted and
    effective capabilities. ``setpcap``: the caller holds ``CAP_SETPCAP``, so the bounding set
    is emptied as well (a container runner holding only what it needs cannot, and need not:
    with ``no_new_privs`` nothing in the bounding set can be regained)."""
    argv = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all"]
    if setpcap:
        argv.append("--bounding-set=-all")
    return (*argv, "--no-new-privs", "--")


SANDBOX_LABEL = "corral.sandbox"


class SandboxError(Exception):
    """A sandbox could not be created, reached or used; the message says which and why."""


class NetworkPolicy(BaseModel):
    """What a sandbox may reach. ``none`` (the default): nothing, not even the host's loopback.
    ``loopback``: only the env server's port on the host. ``allowlist``: those hosts only
    (backends that cannot enforce a policy refuse it at ``create``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["none", "loopback", "allowlist"] = "none"
    allow: tuple[str, ...] = ()
    server_port: int | None = None  # for ``loopback``: the one host port to reach


class Bind(BaseModel):
    """A host path made visible inside the sandbox (read-only unless ``writable``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Path
    target: str
    writable: bool = False


class SandboxSpec(BaseModel):
    """What to create. Limits left ``None`` are the backend's defaults (documented there)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str | None = None  # container image / E2B template; None: the backend's default
    rootfs: Path | None = None  # bwrap: a root filesystem folder; None: the host's /usr, ro
    workdir: str = "/work"
    env: Mapping[str, str] = Field(default_factory=dict)
    cpus: float | None = None
    memory_mb: int | None = None
    pids: int | None = None
    disk_mb: int | None = None
    network: NetworkPolicy = NetworkPolicy()
    ttl_s: float | None = 3600.0
    labels: Mapping[str, str] = Field(default_factory=dict)
    binds: tuple[Bind, ...] = ()


@dataclass(frozen=True, slots=True)
class ExecResult:
    """One command's outcome. ``timed_out``: the command overran its timeout and its whole
    process tree was killed. ``killed``: the sandbox killed it for a limit (memory, pids), with
    ``reason`` saying which when the backend can tell."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    killed: bool = False
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How the env server reaches a service listening inside a sandbox."""

    host: str
    port: int


class SandboxProcess(abc.ABC):
    """A long-running process inside a sandbox, with its stdin and stdout as byte streams.

    The env server runs a bundle's env code this way (:mod:`corral.envs.runner`): requests go
    to stdin, answers come back on stdout, one JSON line each. stderr is drained continuously
    (a chatty process never blocks on a full pipe) and its last :data:`STDERR_TAIL` bytes are
    kept for diagnostics.
    """

    @abc.abstractmethod
    async def write(self, data: bytes) -> None:
        """Send ``data`` to the process's stdin. :class:`SandboxError` once it is gone."""

    @abc.abstractmethod
    async def readline(self) -> bytes:
        """The next line of stdout, newline included; ``b""`` once stdout is closed (the
        process ended or was killed). Lines are capped at :data:`MAX_LINE` bytes: a longer
        one raises :class:`SandboxError`."""

    _killing: asyncio.Future[None] | None = None  # the kill, once asked for

    async def kill(self) -> None:
        """Kill the process and everything it started. Idempotent; never raises but for the
        caller's cancellation, which propagates while the kill (shielded) finishes: the same
        rule as :meth:`Sandbox.close`."""
        if self._killing is None:
            self._killing = asyncio.ensure_future(self._kill())
        await asyncio.shield(self._killing)

    @property
    def killing(self) -> bool:
        """Whether :meth:`kill` was called."""
        return self._killing is not None

    @abc.abstractmethod
    async def _kill(self) -> None:
        """Kill it; called once by :meth:`kill`. Never raises."""

    @abc.abstractmethod
    def stderr_tail(self) -> str:
        """The last bytes the process wrote to stderr, decoded (for error messages)."""


STDERR_TAIL = 64 * 1024
MAX_LINE = 64 * 2**20


class Sandbox(abc.ABC):
    """One live sandbox. Use as an async context manager, or call :meth:`close`."""

    id: str

    @abc.abstractmethod
    async def exec(
        self,
        cmd: Sequence[str],
        *,
        timeout: float,  # noqa: ASYNC109 -- the deadline that kills the process tree inside
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` inside; a timeout kills the whole process tree it started.

        Raises :class:`SandboxError` only when the sandbox itself is unusable (gone, unreachable);
        a failing command is an :class:`ExecResult` with its exit code."""

    @abc.abstractmethod
    async def spawn(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> SandboxProcess:
        """Start ``cmd`` inside and keep it running, its stdin and stdout open to the caller
        (see :class:`SandboxProcess`). It lives until it exits, :meth:`SandboxProcess.kill`,
        or the sandbox closes. Raises :class:`SandboxError` when it cannot be started."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` inside (parents created)."""

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """The bytes at ``path`` inside; :class:`SandboxError` if it does not exist."""

    @abc.abstractmethod
    async def endpoint(self, port: int) -> Endpoint:
        """Where the env server reaches a service listening on ``port`` inside."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Tear down; called once by :meth:`close`."""

    @abc.abstractmethod
    async def is_alive(self) -> bool:
        """Whether the sandbox still runs. Never raises."""

    _closed: bool = False
    _closing: asyncio.Task[None] | None = None

    async def close(self) -> None:
        """Tear the sandbox down. Idempotent, and it finishes even when the caller is cancelled
        (the teardown is shielded; the caller's cancellation is re-raised after it)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)
        self._closed = True

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class SandboxProvider(abc.ABC):
    """Creates sandboxes of one backend, all labelled with ``owner``.

    ``host_binds``: whether ``SandboxSpec.binds`` (host paths mounted inside) are supported;
    backends whose sandboxes run elsewhere (kubernetes, e2b) refuse binds at ``create``, and
    the env server uploads files instead. ``isolated``: whether model actions are contained
    at all (``local`` is not)."""

    name: str
    owner: str
    host_binds: bool = True
    isolated: bool = True

    def model_jail(self, spec: SandboxSpec) -> tuple[str, ...]:
        """The command prefix that runs a model action inside a sandbox of ``spec`` out of
        the env runner's reach (another uid, or its own user and pid namespaces): handed to
        the runner as ``CORRAL_MODEL_JAIL`` (:mod:`corral.envs.model_actions`). Empty: the
        backend keeps nothing between the runner and the model's commands."""
        return ()

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """A new, started sandbox. Records it before creating it (see the module docstring);
        :class:`SandboxError` says why when it cannot be created, and nothing is left behind."""

    @abc.abstractmethod
    async def list_owned(self) -> list[str]:
        """Ids of the live sandboxes this provider's ``owner`` created."""

    @abc.abstractmethod
    async def sweep(self) -> list[str]:
        """Remove sandboxes whose owner is gone (a crashed server) or that outlived their time
        to live; return their ids. Run at start-up."""
