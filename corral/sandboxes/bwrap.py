"""The ``bwrap`` backend: Debian's bubblewrap, one ``bwrap`` invocation per exec.

A sandbox is a host folder (its writable ``workdir``) plus per-sandbox cgroups; every
:meth:`BwrapSandbox.exec` starts a fresh ``bwrap`` with:

- new user (uid/gid 1000 inside), pid, net, ipc, uts and cgroup namespaces (``--unshare-all``);
  ``--die-with-parent``, ``--new-session`` (no TIOCSTI into our terminal), ``--cap-drop ALL``;
- read-only ``/usr`` (+ the ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` symlinks), a minimal
  read-only ``/etc`` (only what the dynamic loader and Python read; never ``/etc/shadow``),
  the spec's binds, a private ``/tmp``, fresh ``/proc`` and ``/dev``, the workdir read-write;
- a seccomp filter built with libseccomp (``pyseccomp``) passed with ``--seccomp FD``: it
  refuses ``ptrace`` (and its relatives). Under ``none`` the network namespace is the exec's own,
  holding nothing but its own loopback: internet sockets are allowed there (a black-box agent
  listens on it, bridged to its gateway by the env server), and lead nowhere else;
- memory, pids (and CPU, if ``spec.cpus``) limits through cgroups v1 at
  ``/sys/fs/cgroup/{memory,pids,cpu}/corral/<id>``: a tiny ``sh`` wrapper writes its own pid into
  ``cgroup.procs`` and then execs ``bwrap``, so everything inside is charged. Where the host does
  not allow that (no v1 hierarchy, no permission), the sandbox is still created, **limits are
  NOT enforced**, a warning is logged and :attr:`BwrapSandbox.limits_enforced` is ``False``.

Policy ``loopback`` uses ``--share-net``: the sandbox shares the **host's network namespace**.
It can then reach *every* host loopback service (not only the env server's port) and the
host's outside network, and services it starts are reachable on the host's 127.0.0.1. Use
``none`` for untrusted actions unless the env truly needs the network (black-box agents are
never run under ``loopback``). ``allowlist`` is refused (bwrap has no per-host filter).

Processes do not outlive their exec: each exec is its own pid namespace, killed when its main
process exits. The command is that namespace's pid 1 (``--as-pid-1``): bwrap's own reaper as
pid 1 is orphaned when bwrap exits, and on a host whose init does not reap orphans promptly
(this machine's does not) every exec then leaked one charge of the pids cgroup until the
sandbox could not fork at all. The price: inside a long-lived :meth:`BwrapSandbox.spawn`,
processes orphaned by the command stay zombies (counted against ``pids``) until it exits.
A timeout SIGKILLs the ``bwrap`` process group; ``--die-with-parent`` then takes the
namespace's pid 1, and with it every process inside.

Defaults when the spec leaves a limit ``None``: 1024 MB memory, 256 pids, no CPU cap.

Model actions (:meth:`BwrapProvider.model_jail`): the env's runner and the model's commands
share the sandbox's uid, so the uid cannot separate them; a nested ``bwrap`` does. Each model
command gets its own user namespace (a child of the sandbox's: no capability over the runner)
and its own pid namespace (the runner's pid names nothing there: ``kill``, ``pidfd_send_signal``
on a ``/proc/<pid>`` fd fail), with :data:`~corral.sandboxes.base.RUNNER_ROOT` (the runner's
code) covered by an empty tmpfs; the sandbox's filesystem, network and seccomp filter (which
refuses ``ptrace``) carry over unchanged. A fresh
``/proc`` cannot be mounted there (the outer one has covered paths), so the outer one stays:
the runner's entries are visible, but the runner makes itself non-dumpable
(:mod:`corral.envs.runner`), which puts its ``mem``, ``environ`` and ``fd/`` behind
``CAP_SYS_PTRACE`` in the sandbox's user namespace, held by nothing inside. About 10 ms a
command.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from corral.sandboxes.base import (
    RUNNER_ROOT,
    Endpoint,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxProcess,
    SandboxProvider,
    SandboxSpec,
)
from corral.sandboxes.cgroups import read_counter, remove_cgroup
from corral.sandboxes.local import DEFAULT_STATE_DIR, HostFolderFiles, PipeProcess, run_tree
from corral.sandboxes.records import Record, RecordStore

log = logging.getLogger(__name__)

DEFAULT_MEMORY_MB = 1024
DEFAULT_PIDS = 256
CGROUP_ROOT = Path("/sys/fs/cgroup")
UID = 1000
# Only what ld.so and Python read; the rest of the host's /etc (shadow, ssh keys...) stays out.
ETC_FILES = (
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/python3",
    "/etc/python3.11",
)
_PTRACE_LIKE = ("ptrace", "process_vm_readv", "process_vm_writev")

_filters: dict[str, bytes] = {}


def seccomp_filter() -> bytes:
    """The BPF program (built by libseccomp, cached): EPERM for ptrace-like calls. Raises
    :class:`SandboxError` if libseccomp (``pyseccomp`` + ``libseccomp2``) is missing: no filter,
    no sandbox."""
    if "ptrace" not in _filters:
        try:
            import pyseccomp as sc
        except (ImportError, OSError, RuntimeError) as e:  # RuntimeError: no libseccomp
            raise SandboxError(f"bwrap backend needs pyseccomp and libseccomp2: {e}") from e
        f = sc.SyscallFilter(sc.ALLOW)
        for call in _PTRACE_LIKE:
            f.add_rule(sc.ERRNO(errno.EPERM), call)
        with tempfile.TemporaryFile() as t:
            f.export_bpf(t)
            t.seek(0)
            _filters["ptrace"] = t.read()
    return _filters["ptrace"]


class BwrapSandbox(HostFolderFiles, Sandbox):
    """One bwrap sandbox (see the module docstring for what is and is not enforced)."""

    def __init__(
        self,
        id: str,
        folder: Path,
        spec: SandboxSpec,
        cgroups: dict[str, Path],
        records: RecordStore,
        bwrap: str,
    ) -> None:
        self.id = id
        self.folder = folder
        self.spec = spec
        self.cgroups = cgroups  # controller -> folder; empty when limits are not enforced
        self.limits_enforced = {"memory", "pids"} <= set(cgroups)
        self._records = records
        self._bwrap = bwrap
        self._running: set[int] = set()

    def _argv(self, cmd: Sequence[str], env: Mapping[str, str], cwd: str, fd: int) -> list[str]:
        net = self.spec.network.mode
        argv = [self._bwrap, "--unshare-all", "--unshare-user"]
        if net == "loopback":
            argv.append("--share-net")
        argv += ["--die-with-parent", "--as-pid-1", "--new-session", "--cap-drop", "ALL"]
        argv += ["--uid", str(UID), "--gid", str(UID), "--hostname", "sandbox"]
        argv += ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            argv += ["--symlink", f"usr/{link}", f"/{link}"]
        for path in ETC_FILES:
            argv += ["--ro-bind-try", path, path]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        argv += ["--bind", str(self.folder), self.spec.workdir]
        argv += ["--dir", RUNNER_ROOT]  # always there, so that the model jail can cover it
        for b in self.spec.binds:
            argv += ["--bind" if b.writable else "--ro-bind", str(b.source), b.target]
        argv += ["--chdir", cwd, "--clearenv"]
        for k, v in env.items():
            argv += ["--setenv", k, v]
        argv += ["--seccomp", str(fd), "--", *cmd]
        if self.cgroups:
            # The wrapper joins the cgroups *before* exec'ing bwrap: nothing runs uncharged.
            procs = [str(p / "cgroup.procs") for p in self.cgroups.values()]
            join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; '
            argv = ["/bin/sh", "-c", join + 'exec "$@"', "sh", *procs, "--", *argv]
        return argv

    def _counters(self) -> tuple[int, int]:
        mem, pids = self.cgroups.get("memory"), self.cgroups.get("pids")
        return (
            read_counter(mem / "memory.oom_control", "oom_kill") if mem else 0,
            read_counter(pids / "pids.events", "max") if pids else 0,
        )

    async def exec(
        self,
        cmd: Sequence[str],
        *,
        timeout: float,  # noqa: ASYNC109
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` in a fresh bwrap. ``killed``/``reason`` are set when the memory cgroup
        OOM-killed or the pids limit refused a fork during this exec (concurrent execs of one
        sandbox share the cgroups, so either may be blamed). Raises :class:`SandboxError` once
        closed or when bwrap cannot be started."""
        before = self._counters()
        fd, argv = self._prepare(cmd, env, cwd)
        try:
            try:
                out = await run_tree(
                    argv,
                    timeout=timeout,
                    env={"PATH": "/usr/bin:/bin"},
                    cwd=self.folder,
                    stdin=stdin,
                    running=self._running,
                    pass_fds=(fd,),
                )
            except OSError as e:
                raise SandboxError(f"cannot start bwrap for {self.id}: {e}") from e
        finally:
            os.close(fd)
        after = self._counters()
        reason = None
        if after[0] > before[0]:
            reason = "memory limit: OOM-killed"
        elif after[1] > before[1]:
            reason = "pids limit: fork refused"
        return ExecResult(
            out.exit_code,
            out.stdout.decode(errors="replace"),
            out.stderr.decode(errors="replace"),
            timed_out=out.timed_out,
            killed=reason is not None,
            reason=reason,
        )

    def _prepare(
        self, cmd: Sequence[str], env: Mapping[str, str] | None, cwd: str | None
    ) -> tuple[int, list[str]]:
        """The seccomp filter's memfd (the caller closes it) and the bwrap argv for ``cmd``."""
        if self._closing is not None:
            raise SandboxError(f"sandbox {self.id} is closed")
        full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": self.spec.workdir}
        full_env |= {"LANG": "C.UTF-8"} | dict(self.spec.env) | dict(env or {})
        fd = os.memfd_create("corral-seccomp")
        os.write(fd, seccomp_filter())
        os.lseek(fd, 0, os.SEEK_SET)
        return fd, self._argv(cmd, full_env, cwd or self.spec.workdir, fd)

    async def spawn(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> SandboxProcess:
        """Start ``cmd`` in a fresh bwrap (its own pid namespace) and keep it running; killing
        it kills the namespace. :class:`SandboxError` once closed or when bwrap cannot start."""
        fd, argv = self._prepare(cmd, env, cwd)
        try:
            return await PipeProcess.start(
                argv,
                env={"PATH": "/usr/bin:/bin"},
                cwd=self.folder,
                running=self._running,
                pass_fds=(fd,),
            )
        except OSError as e:
            raise SandboxError(f"cannot start bwrap for {self.id}: {e}") from e
        finally:
            os.close(fd)

    async def endpoint(self, port: int) -> Endpoint:
        """Under ``loopback`` the host's 127.0.0.1 (shared network namespace; only while the
        exec serving it runs). Under ``none`` there is no path in: :class:`SandboxError`."""
        if self.spec.network.mode != "loopback":
            raise SandboxError(f"{self.id} has network policy {self.spec.network.mode!r}: no path")
        return Endpoint("127.0.0.1", port)

    async def _close(self) -> None:
        await asyncio.to_thread(_destroy, self.folder, list(self.cgroups.values()), self._running)
        self._records.remove(self.id)


def _destroy(folder: Path, cgroups: list[Path], running: set[int] | None = None) -> None:
    for pgid in list(running or ()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for cg in cgroups:
        remove_cgroup(cg)
    shutil.rmtree(folder, ignore_errors=True)


class BwrapProvider(SandboxProvider):
    """Creates :class:`BwrapSandbox` es; records live in ``state_dir/bwrap``."""

    name = "bwrap"

    def __init__(
        self,
        owner: str,
        state_dir: Path | None = None,
        *,
        cgroup_root: Path = CGROUP_ROOT,
        bwrap: str = "bwrap",
    ) -> None:
        self.owner = owner
        self.records = RecordStore(state_dir or DEFAULT_STATE_DIR, self.name)
        self.cgroup_root = cgroup_root
        self.bwrap = bwrap

    def model_jail(self, spec: SandboxSpec) -> tuple[str, ...]:
        """A nested ``bwrap`` (module docstring): new user, pid and ipc namespaces, dying with
        its parent, the sandbox's root as it is but :data:`RUNNER_ROOT` hidden.
        :class:`SandboxError` when the host's ``bwrap`` is not under ``/usr`` (the only host
        folder a sandbox sees)."""
        path = shutil.which(self.bwrap)
        if path is None or not Path(path).resolve().is_relative_to("/usr"):
            raise SandboxError(
                f"{self.bwrap!r} resolves to {path}: not under /usr, not in a sandbox"
            )
        return (
            str(Path(path).resolve()),
            "--unshare-user",
            "--unshare-pid",
            "--unshare-ipc",
            "--die-with-parent",
            "--dev-bind", "/", "/",
            "--tmpfs", RUNNER_ROOT,
            "--",
        )  # fmt: skip

    def _make_cgroups(self, sid: str, spec: SandboxSpec) -> dict[str, Path]:
        """Create and configure the cgroups; ``{}`` (limits not enforced) when not allowed."""
        mem = (spec.memory_mb or DEFAULT_MEMORY_MB) * 2**20
        limits: dict[str, list[tuple[str, str]]] = {
            "memory": [("memory.limit_in_bytes", str(mem)), ("memory.swappiness", "0")],
            "pids": [("pids.max", str(spec.pids or DEFAULT_PIDS))],
        }
        if spec.cpus:
            limits["cpu"] = [
                ("cpu.cfs_period_us", "100000"),
                ("cpu.cfs_quota_us", str(int(spec.cpus * 100000))),
            ]
        made: dict[str, Path] = {}
        try:
            for ctl, settings in limits.items():
                path = self.cgroup_root / ctl / "corral" / sid
                path.mkdir(parents=True)
                made[ctl] = path
                for name, value in settings:
                    (path / name).write_text(value)
            # Also cap swap where the kernel accounts it (memsw files exist only then).
            memsw = made["memory"] / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                with contextlib.suppress(OSError):
                    memsw.write_text(str(mem))
        except OSError as e:
            for path in made.values():
                remove_cgroup(path)
            log.warning("bwrap %s: cgroups unavailable (%s): limits are NOT enforced", sid, e)
            return {}
        return made

    async def create(self, spec: SandboxSpec) -> BwrapSandbox:
        """Record, then make the folder and cgroups. :class:`SandboxError` (nothing left behind)
        for an ``allowlist`` policy, a ``rootfs`` (not supported yet), a missing ``bwrap`` or
        libseccomp, or an unusable state folder."""
        if spec.network.mode == "allowlist":
            raise SandboxError("bwrap cannot enforce an allowlist network policy")
        if spec.rootfs is not None:
            raise SandboxError("bwrap backend: spec.rootfs is not supported yet (host /usr only)")
        if shutil.which(self.bwrap) is None:
            raise SandboxError(f"{self.bwrap!r} not found: apt-get install bubblewrap")
        seccomp_filter()  # fail now, not at the first exec
        sid = f"bw-{uuid.uuid4().hex[:12]}"
        folder = self.records.root / sid
        cg = {c: str(self.cgroup_root / c / "corral" / sid) for c in ("memory", "pids", "cpu")}
        try:
            rec = Record.mine(sid, self.name, self.owner, spec.ttl_s, folder=str(folder), **cg)
            self.records.write(rec)
            folder.mkdir(parents=True)
            cgroups = self._make_cgroups(sid, spec)
        except OSError as e:
            _destroy(folder, [])
            self.records.remove(sid)
            raise SandboxError(f"cannot create bwrap sandbox: {e}") from e
        return BwrapSandbox(sid, folder, spec, cgroups, self.records, self.bwrap)

    async def list_owned(self) -> list[str]:
        owned = self.records.owned(self.owner)
        return [r.id for r in owned if _exists(r.extra.get("folder", ""))]

    async def sweep(self) -> list[str]:
        """Remove sandboxes whose owner process died or whose ttl passed: kill what is left in
        their cgroups, remove the cgroups and the folder, then the record."""
        gone = []
        for r in self.records.stale():
            cgs = [Path(r.extra[c]) for c in ("memory", "pids", "cpu") if c in r.extra]
            await asyncio.to_thread(_destroy, Path(r.extra.get("folder", "/nonexistent")), cgs)
            self.records.remove(r.id)
            gone.append(r.id)
        return gone


def _exists(path: str) -> bool:
    return bool(path) and os.path.isdir(path)
