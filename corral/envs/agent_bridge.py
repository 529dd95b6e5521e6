"""Run a black-box agent in an episode's sandbox: the env server's side.

:func:`run_agent` starts the sandbox side (:mod:`corral.envs.agent_launcher`, standard library
only, shipped in the payload beside the runner) with :meth:`Sandbox.spawn` in the task's
workspace and talks to it over that process's stdin/stdout, one JSON object per line (the
frames are listed in the launcher's docstring):

- the first line down is the launch (argv, env, files, the policy's ``path_dirs``, the kill
  grace, how much of each output stream to send up);
- the launcher listens on ``127.0.0.1:<port>`` *inside* the sandbox (the sandbox's own
  loopback: bwrap's and docker's network namespaces have nothing else), writes the files,
  starts the agent through the model jail (``CORRAL_MODEL_JAIL``) in the workspace, and
  forwards every TCP connection the agent opens to that listener as ``open`` / ``data`` /
  ``eof`` frames; this side opens one TCP (TLS for ``https``) connection to the gateway per
  agent connection and pumps bytes both ways. So the agent reaches the gateway and nothing
  else, on every backend, also where the sandbox is remote (kubernetes, e2b): no network
  path from the sandbox to the gateway is needed at all. A gateway that cannot be reached
  resets the agent's connection; so does one more than :data:`MAX_LINKS` at once, and one
  whose bytes not yet taken by the gateway pass :data:`MAX_LINK_BUFFER` (or all of the run's
  together :data:`MAX_RUN_BUFFER`);
- the agent's stdout and stderr come up as ``out`` / ``err`` frames (only the transcript
  stream's first :data:`MAX_TRANSCRIPT_BYTES`; of both, the last :data:`TAIL_BYTES` in a
  ``tail`` frame), its exit as ``exit``.

The budget counts from the moment the launch is taken. At ``timeout_s`` a ``term`` frame goes
down (the launcher SIGTERMs the agent's process group, and SIGKILLs every process below
itself ``kill_grace_s`` later, those in sessions of their own included); if no ``exit`` has
come :data:`LAUNCHER_GRACE_S` after that, the launcher process is killed
(:meth:`SandboxProcess.kill`). However the run ends (exit, overrun, error, cancellation) the
launcher is asked to kill everything (a ``kill`` frame, waited for at most
:data:`LAUNCHER_GRACE_S`) and then killed, so nothing of the agent is left running.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import ipaddress
import json
import logging
import re
import ssl
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from corral.envs.agent_launcher import CHUNK, MAX_CONNECTIONS
from corral.envs.model_actions import JAIL_VARIABLE
from corral.envs.protocol import AgentLaunch, AgentRun
from corral.sandboxes.base import Sandbox, SandboxError, SandboxProcess

log = logging.getLogger(__name__)

# In-sandbox paths the env server binds the operator's agent CLIs at (bwrap, docker): the
# npm install folder, and a folder of links named after each CLI (put first on PATH).
AGENT_CLIS_ROOT = "/opt/agents"
AGENT_BIN_ROOT = "/opt/agent-bin"
MAX_TRANSCRIPT_BYTES = 8 * 2**20
TAIL_BYTES = 4000
MAX_FILES_BYTES = 32 * 2**20  # all of a launch's files together, decoded
LAUNCHER_GRACE_S = 5.0  # how long the launcher may take to report after term/kill
CONNECT_TIMEOUT_S = 10.0  # to open one connection to the gateway
PROBE_TIMEOUT_S = 10.0  # the exec that tells a dead launcher from a dead sandbox
# Bytes from the agent one connection may hold here, not yet taken by the gateway: past it the
# connection is reset (a gateway that stops reading must not grow the server's memory).
MAX_LINK_BUFFER = 16 * 2**20
# The same, for all of one run's connections together: MAX_LINKS links each at its own bound
# would hold a GiB per agent.
MAX_RUN_BUFFER = 64 * 2**20
# Agent connections bridged at once (each holds a gateway connection, a file descriptor of the
# server's): one more is reset. The launcher caps them the same way (its MAX_CONNECTIONS).
MAX_LINKS = MAX_CONNECTIONS
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LOOPBACK_NAMES = ("localhost",)


class AgentRefused(ValueError):
    """The launch cannot run as given (a gateway the server does not bridge to, a file path
    that climbs out, files too big, a budget over the server's cap); nothing was started."""


@dataclass(frozen=True)
class AgentPolicy:
    """What the env server allows agents. ``gateways``: origins (``scheme://host:port``) it
    bridges agent traffic to; empty: any loopback origin (127.0.0.0/8, ::1, localhost)
    and nothing else. ``max_timeout_s``: the cap on a launch's budget."""

    gateways: tuple[str, ...] = ()
    max_timeout_s: float = 3600.0
    path_dirs: tuple[str, ...] = field(default=())  # in-sandbox folders put first on PATH


@dataclass(frozen=True)
class Origin:
    """A gateway origin, normalised (scheme lower-case, port explicit)."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Origin:
        """``AgentRefused`` unless ``url`` is ``http(s)://host[:port]`` (a trailing ``/`` at
        most: no path, query, fragment or credentials)."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise AgentRefused(f"gateway {url!r} is not a URL: {exc}") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise AgentRefused(f"gateway {url!r}: only http and https are bridged")
        if not parts.hostname or parts.username or parts.password:
            raise AgentRefused(f"gateway {url!r}: give scheme://host:port, nothing else")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise AgentRefused(f"gateway {url!r}: an origin has no path, query or fragment")
        if port == 0:  # no server listens on port 0: it is no gateway's origin
            raise AgentRefused(f"gateway {url!r}: port 0 is no port to connect to")
        default = 443 if scheme == "https" else 80
        return cls(scheme, parts.hostname.lower(), default if port is None else port)

    @property
    def loopback(self) -> bool:
        if self.host in _LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def check_launch(launch: AgentLaunch, policy: AgentPolicy) -> Origin:
    """The gateway origin ``launch`` may be bridged to under ``policy``; :class:`AgentRefused`
    (saying why) when the launch breaks it: gateway not allowed, budget over the cap, a file
    path that is absolute or holds ``..`` (or empty / ``.`` parts), two files at one path,
    content that is not base64, files over :data:`MAX_FILES_BYTES` decoded, an env name that
    is not a variable name, a NUL in argv or env."""
    origin = Origin.parse(launch.gateway)
    if policy.gateways:
        allowed = {Origin.parse(g) for g in policy.gateways}
        if origin not in allowed:
            raise AgentRefused(f"gateway {launch.gateway!r} is not one this server bridges to")
    elif not origin.loopback:
        raise AgentRefused(
            f"gateway {launch.gateway!r} is not a loopback origin, and this server names no "
            "other gateway it bridges to"
        )
    if launch.timeout_s > policy.max_timeout_s:
        raise AgentRefused(
            f"timeout_s {launch.timeout_s:g} is over this server's cap of "
            f"{policy.max_timeout_s:g} s"
        )
    total, seen = 0, set()
    for f in launch.files:
        parts = f.path.split("/")
        if f.path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in f.path:
            raise AgentRefused(f"file path {f.path!r}: give a relative path without '..'")
        if (f.area, f.path) in seen:
            raise AgentRefused(f"file {f.area}:{f.path} is given twice")
        seen.add((f.area, f.path))
        try:
            total += len(base64.b64decode(f.content_b64, validate=True))
        except binascii.Error as exc:
            raise AgentRefused(f"file {f.path!r}: content_b64 is not base64: {exc}") from None
        if total > MAX_FILES_BYTES:
            raise AgentRefused(f"the launch's files are over {MAX_FILES_BYTES} bytes, decoded")
    for name, value in launch.env.items():
        if not _ENV_NAME.fullmatch(name) or "\0" in value:
            raise AgentRefused(f"env {name!r}: not a variable name, or a NUL in its value")
    if any("\0" in a for a in launch.argv):
        raise AgentRefused("argv holds a NUL character")
    return origin


class _Stream:
    """One of the agent's output streams: the first ``keep`` bytes, the tail, the size."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.head = bytearray()
        self.tail = bytearray()
        self.total: int | None = None  # from the launcher's ``tail`` frame

    def add(self, data: bytes) -> None:
        self.head += data[: max(0, self.keep - len(self.head))]
        self.tail += data
        del self.tail[:-TAIL_BYTES]

    def last(self) -> str:
        return bytes(self.tail[-TAIL_BYTES:]).decode(errors="replace")


class _Run:
    """The env server's half of one agent run: frames in, connections to the gateway out."""

    def __init__(
        self,
        process: SandboxProcess,
        launch: AgentLaunch,
        origin: Origin,
        policy: AgentPolicy,
        t0: float,
    ) -> None:
        self.process = process
        self.launch = launch
        self.origin = origin
        self.path_dirs = list(policy.path_dirs)
        self.t0 = t0  # when the launch was taken: every time in the AgentRun counts from it
        self.lock = asyncio.Lock()
        self.links: dict[int, _Link] = {}
        self.queued = 0  # bytes in all the links' inboxes (bounded by MAX_RUN_BUFFER)
        self.resets: set[asyncio.Future[None]] = set()  # resets sent by tasks of their own
        self.transcript = _Stream(MAX_TRANSCRIPT_BYTES)
        self.other = _Stream(0)
        self.streams = {"out": self.transcript, "err": self.other}
        if launch.transcript == "stderr":
            self.streams = {"out": self.other, "err": self.transcript}
        self.started_s: float | None = None
        self.first_request_s: float | None = None
        self.connections = 0
        self.exit: dict[str, Any] | None = None
        self.error: str | None = None
        self.timed_out = False
        self.ssl = ssl.create_default_context() if origin.scheme == "https" else None

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def send(self, frame: dict[str, Any]) -> None:
        """One frame down; writes are serialised. :class:`SandboxError` once it is gone."""
        line = json.dumps(frame, separators=(",", ":")).encode() + b"\n"
        async with self.lock:
            await self.process.write(line)

    async def read_frames(self) -> None:
        """Handle frames until ``exit``, ``error`` or the end of the launcher's stdout."""
        while self.exit is None and self.error is None:
            raw = await self.process.readline()
            if not raw:
                return
            frame = json.loads(raw)
            kind = frame.get("t")
            if kind in ("out", "err"):
                self.streams[kind].add(base64.b64decode(frame["b"]))
            elif kind == "tail":
                stream = self.streams[frame["s"]]
                stream.tail = bytearray(base64.b64decode(frame["b"])[-TAIL_BYTES:])
                stream.total = int(frame["n"])
            elif kind == "open":
                await self.open(int(frame["id"]))
            elif kind in ("data", "eof", "close"):
                link = self.links.get(int(frame["id"]))
                if link is not None:
                    link.from_agent(kind, frame)
            elif kind == "started":
                self.started_s = self.now()
            elif kind == "exit":
                self.exit = frame
            elif kind == "error":
                self.error = str(frame.get("message"))

    async def open(self, cid: int) -> None:
        """Bridge the agent's new connection ``cid`` to the gateway; reset it instead when
        :data:`MAX_LINKS` are bridged already (an id already bridged is ignored: the launcher
        never reuses one)."""
        if cid in self.links:
            return
        if len(self.links) >= MAX_LINKS:
            log.info("agent connection %d: %d are bridged already; reset", cid, MAX_LINKS)
            await self.reset(cid)
            return
        self.connections += 1
        if self.first_request_s is None:
            self.first_request_s = self.now()
        link = _Link(cid, self)
        self.links[cid] = link
        link.task = asyncio.ensure_future(link.run())

    async def reset(self, cid: int) -> None:
        """Have the launcher reset the agent's connection ``cid`` (nothing once it is gone)."""
        with contextlib.suppress(SandboxError):
            await self.send({"t": "close", "id": cid, "abort": True})

    async def drive(self) -> None:
        """Send the launch, read frames, enforce the budget (module docstring)."""
        transcript = "out" if self.launch.transcript == "stdout" else "err"
        other = "err" if transcript == "out" else "out"
        await self.send(
            {
                "t": "launch",
                "argv": self.launch.argv,
                "env": self.launch.env,
                "files": [
                    {"area": f.area, "path": f.path, "b": f.content_b64, "x": f.executable}
                    for f in self.launch.files
                ],
                "path_dirs": self.path_dirs,
                "kill_grace_s": self.launch.kill_grace_s,
                "forward": {transcript: MAX_TRANSCRIPT_BYTES, other: 0},
            }
        )
        reading = asyncio.ensure_future(self.read_frames())
        try:
            remaining = self.launch.timeout_s - self.now()
            done, _ = await asyncio.wait({reading}, timeout=max(0.0, remaining))
            if not done:
                self.timed_out = True
                with contextlib.suppress(SandboxError):
                    await self.send({"t": "term"})
                grace = self.launch.kill_grace_s + LAUNCHER_GRACE_S
                await asyncio.wait({reading}, timeout=grace)
            if reading.done():
                reading.result()  # a broken stream raises here
        finally:
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading

    async def finish(self) -> None:
        """Have the launcher kill everything, then kill it; close the gateway connections."""
        if self.exit is None and self.error is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._kill_frame(), LAUNCHER_GRACE_S)
        await self.process.kill()
        for link in list(self.links.values()):
            link.abort()
        tasks = [link.task for link in self.links.values() if link.task is not None]
        tasks += self.resets
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)

    async def _kill_frame(self) -> None:
        await self.send({"t": "kill"})
        while self.exit is None:  # the launcher ends (closes stdout) once all is killed
            raw = await self.process.readline()
            if not raw:
                return
            with contextlib.suppress(ValueError, KeyError):
                frame = json.loads(raw)
                if frame.get("t") == "exit":
                    self.exit = frame

    def result(self, killed_reason: str | None) -> AgentRun:
        code: int | None = None
        if self.exit is not None and not self.timed_out:
            code = self.exit.get("code")
            sig = self.exit.get("signal")
            if code is None and sig is not None and killed_reason is None:
                killed_reason = f"the agent was killed by signal {sig}"
        total = self.transcript.total
        if total is None:
            total = len(self.transcript.head)
        return AgentRun(
            exit_code=code,
            timed_out=self.timed_out,
            killed_reason=killed_reason,
            stdout_tail=self.streams["out"].last(),
            stderr_tail=self.streams["err"].last(),
            transcript=bytes(self.transcript.head).decode(errors="replace"),
            transcript_truncated=total > MAX_TRANSCRIPT_BYTES,
            started_s=self.started_s,
            first_request_s=self.first_request_s,
            seconds=self.now(),
            gateway_connections=self.connections,
        )


class _Link:
    """One agent connection bridged to one gateway connection."""

    def __init__(self, cid: int, run: _Run) -> None:
        self.id = cid
        self.run_ = run
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.queued = 0  # bytes in the inbox (bounded by MAX_LINK_BUFFER)
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Future[None] | None = None
        self.started = False  # run() has begun: its finally does the cleanup

    def from_agent(self, kind: str, frame: dict[str, Any]) -> None:
        if kind == "data":
            chunk = base64.b64decode(frame["b"])
            over_link = self.queued + len(chunk) > MAX_LINK_BUFFER
            if over_link or self.run_.queued + len(chunk) > MAX_RUN_BUFFER:
                log.info("agent connection %d: the gateway takes too little; reset", self.id)
                self.abort()  # its task ends and tells the launcher to reset the agent's side
                return
            self._count(len(chunk))
            self.inbox.put_nowait(chunk)
        elif kind == "eof":
            self.inbox.put_nowait(None)
        else:  # the agent's side failed: drop ours (abort forgets it, and tells the launcher)
            self.abort()

    def _count(self, n: int) -> None:
        self.queued += n
        self.run_.queued += n

    def abort(self) -> None:
        """Drop the connection. A task cancelled before it began never runs its cleanup
        (nor tells the launcher), so that is done here, the reset sent from a task of its own."""
        if self.task is not None:
            self.task.cancel()
        if self.writer is not None:
            self.writer.transport.abort()
        if not self.started and self.run_.links.pop(self.id, None) is not None:
            self._count(-self.queued)
            reset = asyncio.ensure_future(self.run_.reset(self.id))
            self.run_.resets.add(reset)
            reset.add_done_callback(self.run_.resets.discard)

    async def run(self) -> None:
        """Connect, pump both ways; on any failure reset the agent's connection."""
        self.started = True
        origin = self.run_.origin
        clean = False
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    origin.host,
                    origin.port,
                    ssl=self.run_.ssl,
                    server_hostname=origin.host if self.run_.ssl else None,
                ),
                CONNECT_TIMEOUT_S,
            )
            self.writer = writer
            up = asyncio.ensure_future(self._up(writer))
            try:
                while chunk := await reader.read(CHUNK):
                    await self.run_.send(
                        {"t": "data", "id": self.id, "b": base64.b64encode(chunk).decode()}
                    )
                await self.run_.send({"t": "eof", "id": self.id})
                await up
            finally:
                up.cancel()
            clean = True
        except (OSError, TimeoutError, SandboxError) as exc:
            log.info("agent connection %d to the gateway failed: %s", self.id, exc)
        finally:
            self._count(-self.queued)  # what its inbox holds is dropped with it
            if self.writer is not None:
                self.writer.transport.abort() if not clean else self.writer.close()
            self.run_.links.pop(self.id, None)
            if clean:
                with contextlib.suppress(SandboxError):
                    await self.run_.send({"t": "close", "id": self.id, "abort": False})
            else:
                await self.run_.reset(self.id)

    async def _up(self, writer: asyncio.StreamWriter) -> None:
        while (chunk := await self.inbox.get()) is not None:
            writer.write(chunk)
            await writer.drain()
            self._count(-len(chunk))
        if writer.can_write_eof():
            writer.write_eof()  # TLS cannot half-close: the connection then stays open


async def run_agent(
    sandbox: Sandbox,
    launch: AgentLaunch,
    *,
    python: str,
    code_root: str,
    jail: Sequence[str],
    workdir: str,
    policy: AgentPolicy,
) -> AgentRun:
    """Run ``launch`` in ``sandbox`` (module docstring) and return how it ended.

    ``python``: the interpreter inside; ``code_root``: where the payload (holding
    ``corral/envs/agent_launcher.py``) is inside; ``jail``: the provider's model jail prefix;
    ``workdir``: the task's workspace (the agent's working folder).

    Raises :class:`AgentRefused` before starting anything when the launch breaks ``policy``,
    and :class:`~corral.sandboxes.base.SandboxError` when the launcher cannot be started (also
    when it reports that it cannot listen or start the agent) or the sandbox dies under it. An
    agent that crashes, overruns or is killed is an :class:`AgentRun`, never an exception; so
    is a launcher that dies while the sandbox lives (``exit_code`` None, ``killed_reason``
    saying so). Cancellation kills the launcher (and so the agent) before it propagates.
    """
    t0 = time.monotonic()
    origin = check_launch(launch, policy)
    process = await sandbox.spawn(
        [python, "-m", "corral.envs.agent_launcher"],
        env={
            "PYTHONPATH": code_root,
            "PYTHONDONTWRITEBYTECODE": "1",
            JAIL_VARIABLE: json.dumps(list(jail)),
        },
        cwd=workdir,
    )
    run = _Run(process, launch, origin, policy, t0)
    killed_reason: str | None = None
    try:
        try:
            await run.drive()
        except (SandboxError, ValueError, KeyError, TypeError) as exc:
            # A broken stream (SandboxError) or a frame that is not one (the others).
            if not await _usable(sandbox):
                raise SandboxError(f"sandbox {sandbox.id} is gone under the agent: {exc}") from exc
            killed_reason = f"the agent's launcher failed: {exc}"
        if run.error is not None:
            raise SandboxError(f"the agent could not be started in {sandbox.id}: {run.error}")
        if run.exit is None and killed_reason is None and not run.timed_out:
            if not await _usable(sandbox):
                raise SandboxError(f"sandbox {sandbox.id} is gone under the agent")
            tail = process.stderr_tail().strip()[-1500:]
            killed_reason = "the agent's launcher ended without reporting the agent's exit" + (
                f"; its stderr ends: {tail}" if tail else ""
            )
    finally:
        await _uncancellable(run.finish())
    return run.result(killed_reason)


async def _usable(sandbox: Sandbox) -> bool:
    """Whether the sandbox still runs commands: alive, and a trivial exec works (a sandbox
    being removed may still look alive for a moment after its processes died)."""
    if not await sandbox.is_alive():
        return False
    try:
        return (await sandbox.exec(["true"], timeout=PROBE_TIMEOUT_S)).exit_code == 0
    except SandboxError:
        return False


async def _uncancellable(cleanup: Coroutine[Any, Any, None]) -> None:
    """Run ``cleanup`` to its end even when the caller is cancelled (once or more), and then
    let the cancellation go on: the agent is killed before the caller's cancel propagates."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()
