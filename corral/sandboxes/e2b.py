"""The ``e2b`` backend: one E2B sandbox (a microVM in E2B's cloud) per sandbox, through the
``e2b`` SDK (an optional extra: ``pip install 'corral[e2b]'``; it needs ``E2B_API_KEY``).

What each sandbox gets (:meth:`E2BProvider.create`):

- the template ``spec.image`` or the provider's (default ``base``, E2B's stock template). CPU,
  memory and disk are the template's (set when it was built): ``cpus``, ``memory_mb``,
  ``disk_mb`` and ``pids`` in a spec are *not* applied; the provider logs a warning naming them
  (once per provider) instead of failing, since the VM's own size still bounds the sandbox.
  Size the template for the bundles it serves. Commands run as the template's default user;
  the working folder is created (mode 1777) if the template lacks it;
- a time to live: ``timeout`` = ``ttl_s`` rounded up (``None``: E2B's maximum, 24 h) with
  ``on_timeout: kill``, so E2B's service kills the sandbox when it is over even if no sweep
  ever runs;
- network: policy ``none`` -> ``allow_internet_access=False``: no egress to any address. What
  still works is E2B's own control plane: the SDK reaches envd (the agent inside) through E2B's
  proxy, which is how commands and files travel; nothing inside can open a connection out.
  Policy ``allowlist`` -> ``network={"allow_out": hosts, "deny_out": ["0.0.0.0/0"]}``: E2B
  enforces it (IPs, CIDRs or domain names; no ports, so ``host:port`` entries are refused).
  Policy ``loopback`` is refused: the sandbox runs in E2B's cloud, where the env server's port
  on the operator's loopback does not exist. Ports inside are private
  (``allow_public_traffic=False``) unless the provider is made with ``public_endpoints=True``,
  which makes :meth:`E2BSandbox.endpoint` usable and exposes those ports to anyone who knows
  the sandbox's host name;
- metadata: ``corral.owner``, ``corral.sandbox`` (a name chosen before the create call, also
  sent as the request's idempotency key so that the SDK's retries never make a second
  sandbox), the owner's host, boot id, pid and process start time, the expiry time, and
  ``spec.labels``. Metadata is set atomically with the create call: a server that crashes
  between "create requested" and "create answered" leaves a labelled sandbox that
  :meth:`E2BProvider.sweep` removes (and that E2B kills at its time to live anyway).

Exec follows :mod:`corral.sandboxes.shell`: the command runs through envd as
``setsid sh -c ... timeout --kill-after=1 T cmd``, a session of its own whose id is written to a
file under ``/tmp/.corral``. ``timeout`` signals the command's process group; then the wrapper
SIGKILLs everything left in the session. If the exec has not answered
:data:`~corral.sandboxes.shell.HOST_GRACE_S` after that, the host kills the session through a
second command and the envd process itself; a cancelled exec or spawn is killed the same way
(once started, if cancelled while starting). A process that leaves the session (``setsid``) escapes
these kills but dies with the sandbox at ``close``. A spawned process's session goes with it:
when it ends (by itself, or killed: a launcher killed outright) the wrapper kills what is left
in the session, as the kubernetes backend does. The template needs ``sh``, ``setsid``
(util-linux), ``timeout`` (coreutils), ``sed`` and ``cut``: every Debian/Ubuntu image has them.

What can be tested without E2B's service is tested against a stand-in of it
(``tests/test_sandbox_e2b.py``); ``docs/e2b.md`` has the manual check against the real service.

Model actions (:meth:`SandboxProvider.model_jail`): empty for now. E2B runs commands as the
template's ``user`` or as ``root``; running the runner as root and the model's commands through
``setpriv`` to ``user`` (as the docker backend does) would keep them apart, but the test
stand-in runs every command as the host's own user, where that switch cannot be checked.
What holds is the runner's own hardening (:mod:`corral.envs.runner`: non-dumpable, private
protocol descriptors); the model can still signal the runner and change its uploaded code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import inspect
import logging
import math
import os
import re
import shlex
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from types import ModuleType
from typing import Any

from corral.sandboxes import shell
from corral.sandboxes.base import (
    MAX_LINE,
    OWNER_LABEL,
    SANDBOX_LABEL,
    Endpoint,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxProcess,
    SandboxProvider,
    SandboxSpec,
)
from corral.sandboxes.ownership import EXPIRES_LABEL, expired, owner_gone, owner_labels
from corral.sandboxes.streams import LineBuffer

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "base"
MAX_TTL_S = 24 * 3600  # E2B's longest sandbox lifetime (Pro tier; Hobby is 1 h)
STREAM_SLACK_S = 5.0  # envd's own deadline for an exec's stream: a backstop after ours
KILL_WAIT_S = 10.0  # how long a killed command's stream may take to end
ALL_TRAFFIC = "0.0.0.0/0"
_INSTALL_HINT = "pip install 'corral[e2b]'"

# Keywords this backend passes, per SDK method: checked against the installed SDK's signatures
# at first use, so an SDK too old for them fails with a message instead of a TypeError later.
_REQUIRED_KEYWORDS: dict[str, tuple[str, ...]] = {
    "AsyncSandbox.create": (
        "template",
        "timeout",
        "metadata",
        "envs",
        "allow_internet_access",
        "network",
        "lifecycle",
        "idempotency_key",
    ),
    "Commands.run": (
        "background",
        "envs",
        "user",
        "cwd",
        "on_stdout",
        "on_stderr",
        "stdin",
        "timeout",
    ),
    "Filesystem.write": ("use_octet_stream",),
    "Filesystem.read": ("format",),
}


# -- the SDK -----------------------------------------------------------------------------------


def _load_e2b() -> ModuleType:
    """The ``e2b`` package; :class:`SandboxError` with the install command when it is missing."""
    try:
        import e2b
    except ImportError as e:
        raise SandboxError(
            f"the e2b backend needs the e2b SDK, which is not installed: {_INSTALL_HINT}"
        ) from e
    return e2b


def _sdk_version() -> str:
    try:
        return importlib.metadata.version("e2b")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def _keywords(fn: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(fn).parameters)


def missing_keywords(e2b: ModuleType, sandbox_cls: Any) -> dict[str, set[str]]:
    """Per SDK method, the keywords this backend passes that the installed SDK lacks (empty
    when it has them all)."""
    from e2b.sandbox_async.commands.command import Commands
    from e2b.sandbox_async.filesystem.filesystem import Filesystem

    methods: dict[str, Callable[..., Any]] = {
        "AsyncSandbox.create": sandbox_cls.create,
        "Commands.run": Commands.run,
        "Filesystem.write": Filesystem.write,
        "Filesystem.read": Filesystem.read,
    }
    missing = {name: set(_REQUIRED_KEYWORDS[name]) - _keywords(fn) for name, fn in methods.items()}
    return {name: kws for name, kws in missing.items() if kws}


# -- the sandbox -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Outcome:
    exit_code: int
    stdout: str
    stderr: str


class E2BSandbox(Sandbox):
    """One E2B sandbox. ``id`` is E2B's sandbox id (what its dashboard and CLI show);
    ``name`` is the ``corral.sandbox`` label chosen before it was created."""

    def __init__(
        self,
        sdk_sandbox: Any,
        e2b: ModuleType,
        *,
        name: str,
        spec: SandboxSpec,
        public_endpoints: bool = False,
        state_dir: str = shell.STATE_DIR,
    ) -> None:
        self.id = str(sdk_sandbox.sandbox_id)
        self.name = name
        self.spec = spec
        self._sbx = sdk_sandbox
        self._e2b = e2b
        self._public = public_endpoints
        self._state_dir = state_dir
        self._cleanups: set[asyncio.Future[None]] = set()  # strong refs while they run

    def _error(self, what: str, e: BaseException) -> SandboxError:
        return SandboxError(f"e2b sandbox {self.id}: {what}: {type(e).__name__}: {e}")

    def _check_open(self) -> None:
        if self._closing is not None:
            raise SandboxError(f"e2b sandbox {self.id} is closed")

    def _abs(self, path: str) -> str:
        p = PurePosixPath(path)
        return str(p if p.is_absolute() else PurePosixPath(self.spec.workdir) / p)

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return dict(self.spec.env) | dict(env or {})

    async def _run(self, line: str, **kw: Any) -> Any:
        """``commands.run`` of a command line; SDK failures to start it (sandbox gone,
        unreachable, a working folder that does not exist) become :class:`SandboxError`."""
        try:
            return await self._sbx.commands.run(line, **kw)
        except Exception as e:
            raise self._error("cannot start a command", e) from e

    async def prepare(self) -> None:
        """Create the working folder unless the template has it: as root (the default user
        may not write where it goes), mode 1777 so that the default user can.
        :class:`SandboxError` if that fails."""
        q = shlex.quote(self.spec.workdir)
        try:
            await self._sbx.commands.run(
                f"[ -d {q} ] || install -d -m 1777 {q}", user="root", timeout=60
            )
        except Exception as e:
            raise self._error(f"cannot create the working folder {self.spec.workdir}", e) from e

    # -- exec ---------------------------------------------------------------------------------

    async def _outcome(self, handle: Any) -> _Outcome:
        """Wait for a command started in the background. The SDK raises
        ``CommandExitException`` for a non-zero exit; that is an outcome here, not an error.
        Anything else (the sandbox went away mid-command) is a :class:`SandboxError`."""
        try:
            res = await handle.wait()
        except self._e2b.CommandExitException as e:
            res = e
        except Exception as e:
            raise self._error("the command's stream failed", e) from e
        # envd reports -1 for a process ended by a signal (Go's ExitCode()); with the wrapper
        # that only happens when the host killed it, with SIGKILL.
        code = int(res.exit_code)
        return _Outcome(137 if code < 0 else code, res.stdout or "", res.stderr or "")

    async def kill_session(self, files: shell.SessionFiles) -> None:
        """SIGKILL the session named in ``files.sid`` through a second command and remove the
        files. Best effort: failures are logged, not raised (the sandbox's end kills
        everything anyway)."""
        line = shell.kill_line(files.sid, *files.paths, procps=False)
        try:
            await self._sbx.commands.run(line, timeout=30)
        except Exception as e:
            log.warning("e2b sandbox %s: could not kill session %s: %s", self.id, files.sid, e)

    async def _write(self, path: str, data: bytes) -> None:
        try:
            await self._sbx.files.write(path, data, use_octet_stream=True)
        except Exception as e:
            raise self._error(f"cannot write {path}", e) from e

    async def _start(self, line: str, files: shell.SessionFiles, **kw: Any) -> Any:
        """Start ``line`` in the background; the SDK's handle. :class:`SandboxError` as for
        :meth:`_run`. A caller cancelled while it starts still gets it killed (once started,
        in a task of its own), so a cancellation never leaves a command running."""
        starting = asyncio.ensure_future(self._run(line, background=True, **kw))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            cleanup = asyncio.ensure_future(self._abort_started(starting, files))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
            await asyncio.shield(cleanup)
            raise

    async def _abort_started(
        self, starting: asyncio.Future[Any], files: shell.SessionFiles
    ) -> None:
        try:
            handle = await starting
        except Exception:
            return  # it never started
        await self._abort(handle, files)

    async def _abort(self, handle: Any, files: shell.SessionFiles) -> None:
        """Kill a command's session, remove its files and kill its envd process. Never
        raises."""
        await self.kill_session(files)
        with contextlib.suppress(Exception):
            await handle.kill()

    async def exec(
        self,
        cmd: Sequence[str],
        *,
        timeout: float,  # noqa: ASYNC109 -- the deadline that kills the process tree inside
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` inside (see the module docstring for how a timeout kills its tree).
        ``stdin`` travels as a file written first (one upload, any size, binary-safe).
        :class:`SandboxError` when the sandbox is closed or gone, or ``cwd`` does not exist."""
        if not cmd:
            raise ValueError("exec needs a command")
        self._check_open()
        files = shell.SessionFiles.new(self._state_dir, stdin=stdin is not None)
        if stdin is not None and files.stdin:
            await self._write(files.stdin, stdin)
        t = shell.inner_timeout(timeout)
        full_env = self._env(env)
        deadline = shell.host_deadline(t)
        started = time.monotonic()
        handle = await self._start(
            shell.e2b_exec_line(cmd, files, env=full_env, t=t),
            files,
            envs=full_env,
            cwd=self._abs(cwd or self.spec.workdir),
            timeout=deadline + STREAM_SLACK_S,
        )
        waiting = asyncio.ensure_future(self._outcome(handle))

        async def kill() -> None:
            await self._abort(handle, files)

        out, host_killed = await shell.wait_or_kill(
            waiting,
            deadline=deadline,
            kill=kill,
            kill_wait=KILL_WAIT_S,
            drop=waiting.cancel,
            lost=_Outcome(137, "", ""),
        )
        elapsed = time.monotonic() - started
        timed_out = shell.timed_out(out.exit_code, elapsed, t, host_killed=host_killed)
        return ExecResult(
            exit_code=out.exit_code,
            stdout=out.stdout,
            stderr=out.stderr,
            timed_out=timed_out,
            reason="timeout" if timed_out else None,
        )

    async def spawn(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> SandboxProcess:
        """Start ``cmd`` inside, in a session of its own, with stdin open. :class:`SandboxError`
        when the sandbox is closed or gone, or ``cwd`` does not exist."""
        if not cmd:
            raise ValueError("spawn needs a command")
        self._check_open()
        files = shell.SessionFiles.new(self._state_dir)
        full_env = self._env(env)
        proc = E2BProcess(functools.partial(self.kill_session, files))
        handle = await self._start(
            shell.e2b_spawn_line(cmd, files, env=full_env),
            files,
            stdin=True,
            envs=full_env,
            cwd=self._abs(cwd or self.spec.workdir),
            timeout=0,  # no deadline: it lives until it exits, is killed or the sandbox ends
            on_stdout=proc.on_stdout,
            on_stderr=proc.on_stderr,
        )
        proc.attach(handle)
        return proc

    # -- files --------------------------------------------------------------------------------

    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` (relative paths are under ``workdir``; parents are
        created by envd). :class:`SandboxError` when it cannot be written."""
        self._check_open()
        await self._write(self._abs(path), data)

    async def read_file(self, path: str) -> bytes:
        """The bytes at ``path``; :class:`SandboxError` when it does not exist or cannot be
        read."""
        self._check_open()
        full = self._abs(path)
        try:
            data = await self._sbx.files.read(full, format="bytes")
        except self._e2b.NotFoundException as e:
            raise SandboxError(f"e2b sandbox {self.id}: {full} does not exist") from e
        except Exception as e:
            raise self._error(f"cannot read {full}", e) from e
        return bytes(data)

    # -- the rest -----------------------------------------------------------------------------

    async def endpoint(self, port: int) -> Endpoint:
        """``<port>-<id>.<domain>:443``: E2B's proxy, over HTTPS, when the provider was made
        with ``public_endpoints=True``. Otherwise the sandbox's ports are private (reaching
        them needs E2B's traffic token, which an :class:`Endpoint` cannot carry) and this
        raises :class:`SandboxError`: talk to code inside through exec/spawn instead."""
        if not self._public:
            raise SandboxError(
                f"e2b sandbox {self.id} keeps its ports private; talk to it through exec or "
                "spawn, or make the provider with public_endpoints=True"
            )
        return Endpoint(str(self._sbx.get_host(port)), 443)

    async def is_alive(self) -> bool:
        """Whether envd inside answers its health check. Never raises: a check that fails is
        "not alive" (logged, with the error)."""
        if self._closing is not None:
            return False
        try:
            return bool(await self._sbx.is_running())
        except Exception as e:
            log.warning("e2b sandbox %s: its health check failed: %s", self.id, e)
            return False

    async def _close(self) -> None:
        """Kill the sandbox; one that is already gone is fine. :class:`SandboxError` when the
        kill request fails (the sandbox then ends at its time to live or the next sweep)."""
        try:
            await self._sbx.kill()
        except Exception as e:
            raise self._error("cannot kill the sandbox", e) from e


class E2BProcess(SandboxProcess):
    """A process started in the background through envd. The SDK hands its output over as
    decoded text chunks (UTF-8, invalid bytes replaced); they are re-encoded and split into
    lines for :meth:`readline`."""

    def __init__(self, kill_session: Callable[[], Awaitable[None]]) -> None:
        self._kill_session = kill_session  # kills the process's session inside; never raises
        self._handle: Any = None
        self._out = LineBuffer(MAX_LINE)
        self._ended: asyncio.Future[None] | None = None

    def attach(self, handle: Any) -> None:
        """Start watching ``handle`` (the SDK's command handle) for the end of the process."""
        self._handle = handle
        self._ended = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        # The handle's wait ends with the stream: exit (CommandExitException when non-zero),
        # kill, or the sandbox going away. Which one does not matter to a reader: EOF.
        with contextlib.suppress(Exception):
            await self._handle.wait()
        self._out.close()

    def on_stdout(self, chunk: str) -> None:
        """The SDK's stdout callback (decoded text): re-encoded, split into lines."""
        self._out.feed(chunk.encode())

    def on_stderr(self, chunk: str) -> None:
        """The SDK's stderr callback: the last :data:`STDERR_TAIL` bytes are kept."""
        self._out.add_stderr(chunk.encode())

    async def write(self, data: bytes) -> None:
        if self.killing or (self._ended is not None and self._ended.done()):
            raise SandboxError("the process has exited")
        try:
            await self._handle.send_stdin(data)
        except Exception as e:
            raise SandboxError(f"the process has exited: {type(e).__name__}: {e}") from e

    async def readline(self) -> bytes:
        return await self._out.readline()

    async def _kill(self) -> None:
        """Kill the process's session inside and its envd process."""
        await self._kill_session()
        with contextlib.suppress(Exception):
            await self._handle.kill()
        if self._ended is not None:
            # Its stream ends once envd sees the process die; readers then get EOF.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._ended), KILL_WAIT_S)

    def stderr_tail(self) -> str:
        return self._out.stderr_tail()


# -- the provider ------------------------------------------------------------------------------

_HOST_PORT = re.compile(r"^[^:/\s]+:\d+$")
_UNAPPLIED_LIMITS = ("cpus", "memory_mb", "disk_mb", "pids")


class E2BProvider(SandboxProvider):
    """E2B sandboxes labelled with ``owner`` (see the module docstring for what each gets).

    ``template``: the default template (``spec.image`` wins). ``api_key``: default
    ``E2B_API_KEY``. ``sdk``: the ``AsyncSandbox`` class to call (default ``e2b.AsyncSandbox``,
    imported at first use); tests or subclasses may pass their own, the ``e2b`` package is
    still needed for its exceptions and list query. ``api_params``: further SDK connection
    options for every call (``domain``, ``request_timeout``, ...). ``public_endpoints``: let
    anyone who knows a sandbox's host name reach its ports (needed by :meth:`E2BSandbox.endpoint`).
    ``state_dir``: the folder inside each sandbox for exec bookkeeping (session ids, stdin).
    """

    name = "e2b"
    host_binds = False  # the sandbox runs in E2B's cloud: no host path can be mounted

    def __init__(
        self,
        owner: str,
        *,
        template: str = DEFAULT_TEMPLATE,
        api_key: str | None = None,
        sdk: Any = None,
        api_params: Mapping[str, Any] | None = None,
        public_endpoints: bool = False,
        state_dir: str = shell.STATE_DIR,
    ) -> None:
        self.owner = owner
        self.template = template
        self.public_endpoints = public_endpoints
        self.state_dir = state_dir
        self._api_key = api_key
        self._sdk = sdk
        self._api_params = dict(api_params or {})
        self._e2b: ModuleType | None = None
        self._warned_limits = False

    def _load(self) -> tuple[ModuleType, Any]:
        """The ``e2b`` module and the ``AsyncSandbox`` class, checked once. :class:`SandboxError`
        when the SDK is missing or too old for the keywords this backend passes."""
        if self._e2b is None:
            e2b = _load_e2b()
            sdk = self._sdk if self._sdk is not None else e2b.AsyncSandbox
            missing = missing_keywords(e2b, sdk)
            if missing:
                version = _sdk_version()
                detail = "; ".join(f"{m} lacks {', '.join(sorted(k))}" for m, k in missing.items())
                raise SandboxError(
                    f"the installed e2b SDK ({version}) is too old for the e2b backend "
                    f"({detail}): pip install -U 'corral[e2b]'"
                )
            self._e2b, self._sdk = e2b, sdk
        return self._e2b, self._sdk

    def _params(self) -> dict[str, Any]:
        """Connection options for SDK calls; :class:`SandboxError` without an API key."""
        key = self._api_key or os.environ.get("E2B_API_KEY")
        if not key:
            raise SandboxError("the e2b backend needs an API key: set E2B_API_KEY")
        return {**self._api_params, "api_key": key}

    # -- create -------------------------------------------------------------------------------

    def _network(self, spec: SandboxSpec) -> dict[str, Any]:
        """The create call's network keywords for ``spec.network``; :class:`SandboxError` for
        a policy E2B cannot enforce (see the module docstring)."""
        policy = spec.network
        net: dict[str, Any] = {"allow_public_traffic": self.public_endpoints}
        if policy.mode == "loopback":
            raise SandboxError(
                "the e2b backend cannot honour network policy 'loopback': the sandbox runs in "
                "E2B's cloud, where the env server's port on this host's loopback does not "
                "exist; use policy 'none' (the env server talks to it through exec/spawn)"
            )
        if policy.mode == "none":
            return {"allow_internet_access": False, "network": net}
        bad = [h for h in policy.allow if _HOST_PORT.match(h) or "://" in h]
        if bad:
            raise SandboxError(
                f"the e2b backend allows hosts, IPs or CIDRs, not ports or URLs: {bad}"
            )
        net |= {"allow_out": list(policy.allow), "deny_out": [ALL_TRAFFIC]}
        return {"network": net}

    def _warn_limits(self, spec: SandboxSpec) -> None:
        asked = [f for f in _UNAPPLIED_LIMITS if getattr(spec, f) is not None]
        if asked and not self._warned_limits:
            self._warned_limits = True
            log.warning(
                "e2b sandboxes get CPU, memory and disk from their template; the spec's %s "
                "are not applied (size the template instead)",
                ", ".join(asked),
            )

    @staticmethod
    def _ttl(spec: SandboxSpec) -> int:
        """E2B's ``timeout`` for ``spec.ttl_s``: whole seconds, at most :data:`MAX_TTL_S`
        (``None``: that maximum; a longer one is cut to it, with a warning)."""
        if spec.ttl_s is None:
            return MAX_TTL_S
        if spec.ttl_s > MAX_TTL_S:
            log.warning("e2b sandboxes live at most %d s; ttl_s=%s is cut", MAX_TTL_S, spec.ttl_s)
        return min(MAX_TTL_S, max(1, math.ceil(spec.ttl_s)))

    def _metadata(self, name: str, spec: SandboxSpec, now: float) -> dict[str, str]:
        meta = dict(spec.labels)  # corral's own labels win over same-named spec labels
        meta |= owner_labels(None) | {OWNER_LABEL: self.owner, SANDBOX_LABEL: name}
        if spec.ttl_s is not None:
            meta[EXPIRES_LABEL] = f"{now + min(spec.ttl_s, MAX_TTL_S):.3f}"
        return meta

    def create_kwargs(self, name: str, spec: SandboxSpec) -> dict[str, Any]:
        """Every keyword of the SDK's ``AsyncSandbox.create`` call for ``spec`` (connection
        options included). :class:`SandboxError` for what this backend refuses: binds, a
        root filesystem, network policy ``loopback``, an allowlist with ports."""
        if spec.binds:
            raise SandboxError(
                "the e2b backend cannot mount host paths (spec.binds): the sandbox runs in "
                "E2B's cloud; upload files with write_file instead"
            )
        if spec.rootfs is not None:
            raise SandboxError("the e2b backend runs templates; spec.rootfs is for bwrap")
        return {
            "template": spec.image or self.template,
            "timeout": self._ttl(spec),
            "metadata": self._metadata(name, spec, time.time()),
            "envs": dict(spec.env),
            **self._network(spec),
            "lifecycle": {"on_timeout": "kill"},
            "idempotency_key": name,
            **self._params(),
        }

    async def create(self, spec: SandboxSpec) -> E2BSandbox:
        """A new, started E2B sandbox with its working folder made. :class:`SandboxError` when
        the spec asks for what E2B cannot do or the service refuses; whatever was made is
        killed again (after a crash here, the sweep or E2B's time to live removes it)."""
        e2b, sdk = self._load()
        name = f"corral-{uuid.uuid4().hex}"  # the idempotency key: lowercase, digits, '-'
        kwargs = self.create_kwargs(name, spec)
        self._warn_limits(spec)
        try:
            sbx = await sdk.create(**kwargs)
        except BaseException as e:
            # The request may have reached E2B (a lost answer, a cancellation): kill by label.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._kill_labelled({SANDBOX_LABEL: name}))
            if isinstance(e, Exception):
                raise SandboxError(f"e2b sandbox could not be created: {e}") from e
            raise
        sandbox = E2BSandbox(
            sbx,
            e2b,
            name=name,
            spec=spec,
            public_endpoints=self.public_endpoints,
            state_dir=self.state_dir,
        )
        try:
            await sandbox.prepare()
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(sandbox.close())
            raise
        return sandbox

    # -- listing and sweeping -----------------------------------------------------------------

    async def _list(self, metadata: Mapping[str, str] | None, *, running_only: bool) -> list[Any]:
        """Every sandbox (running and paused, or running only) whose metadata holds
        ``metadata``, across all pages. :class:`SandboxError` when the service fails."""
        e2b, sdk = self._load()
        query = e2b.SandboxQuery(
            metadata=dict(metadata) if metadata else None,
            state=[e2b.SandboxState.RUNNING] if running_only else None,
        )
        try:
            pages = sdk.list(query=query, limit=100, **self._params())
            found: list[Any] = []
            while pages.has_next:
                found += await pages.next_items()
        except SandboxError:
            raise
        except Exception as e:
            raise SandboxError(f"cannot list e2b sandboxes: {type(e).__name__}: {e}") from e
        return found

    async def _kill(self, sandbox_id: str) -> None:
        _, sdk = self._load()
        try:
            await sdk.kill(sandbox_id, **self._params())
        except Exception as e:
            raise SandboxError(f"cannot kill e2b sandbox {sandbox_id}: {e}") from e

    async def _kill_labelled(self, metadata: Mapping[str, str]) -> list[str]:
        found = await self._list(metadata, running_only=False)
        for info in found:
            await self._kill(info.sandbox_id)
        return [info.sandbox_id for info in found]

    async def list_owned(self) -> list[str]:
        """E2B ids of the running sandboxes labelled with this provider's owner."""
        found = await self._list({OWNER_LABEL: self.owner}, running_only=True)
        return sorted(info.sandbox_id for info in found)

    async def sweep(self) -> list[str]:
        """Kill corral sandboxes (any owner's, running or paused) whose owner process is
        provably gone (same host: pid + start time + boot id) or whose ``corral.expires``
        passed; return their E2B ids. Sandboxes of live owners, of other hosts' owners (not
        expired) and without a ``corral.owner`` label are left alone."""
        now = time.time()
        gone: list[str] = []
        for info in await self._list(None, running_only=False):
            meta = info.metadata or {}
            if OWNER_LABEL in meta and (owner_gone(meta) or expired(meta, now)):
                await self._kill(info.sandbox_id)
                gone.append(info.sandbox_id)
        return sorted(gone)
