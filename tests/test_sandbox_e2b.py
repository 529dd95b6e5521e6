"""The e2b sandbox backend, driven through the real ``e2b`` SDK against a stand-in of E2B.

E2B's service cannot be reached from here, so these tests run :class:`StandIn`: **test code
that stands in for E2B**, served over HTTP on 127.0.0.1. The real SDK (``e2b.AsyncSandbox``,
unmodified, pointed at it with ``api_url``/``sandbox_url``) talks to it with its own HTTP and
Connect clients, so every call the backend makes goes through the SDK's real argument handling,
request building, error mapping and response parsing. The stand-in covers exactly what the
backend uses, no more:

- the control plane (REST, JSON): ``POST /v2/sandboxes`` (create; it records each request's
  body and headers for the tests to check), ``GET /v2/sandboxes`` (list with a metadata and
  state query, paginated through ``x-next-token``), ``DELETE /sandboxes/{id}`` (kill);
- envd, the agent inside a sandbox (Connect RPC with the SDK's own generated service
  definition, JSON codec): ``process.Process/Start`` (runs the command as a *real local
  process*, streams its output, honours the stream deadline like envd: the direct process is
  killed), ``SendInput``, ``SendSignal``, ``CloseStdin``; and HTTP ``GET``/``POST /files``
  (octet-stream uploads only: the backend asks for them) and ``GET /health``;
- E2B's proxy in front of envd: requests for a sandbox that is gone get its 502 "was not found".

Commands run on this host as the test's user, so a "sandbox" is only a marker in the processes'
environment (killing a sandbox kills every process carrying its marker) and tests use working
folders under ``tmp_path``. What this cannot show: E2B's real isolation, its network
enforcement, template contents, quotas, and the real service's behaviour where it differs from
this stand-in; ``docs/e2b.md`` has the manual check against the real service.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("e2b", reason="the e2b SDK is not installed (pip install 'corral[e2b]')")

import e2b
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_pb
from e2b.envd.process.process_connect import Process, ProcessASGIApplication
from protobuf import Oneof
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from corral.sandboxes import e2b as backend
from corral.sandboxes import ownership, shell
from corral.sandboxes.base import (
    OWNER_LABEL,
    SANDBOX_LABEL,
    Bind,
    Endpoint,
    NetworkPolicy,
    SandboxError,
    SandboxSpec,
)
from corral.sandboxes.e2b import E2BProvider, E2BSandbox
from corral.sandboxes.records import process_start_time
from tests.servers import serve

GRIDSIM = Path(__file__).resolve().parent.parent / "bundles" / "gridsim"
API_KEY = "e2b_standin_key"
ENVD_VERSION = "0.6.4"  # a recent envd: stdin control, octet-stream uploads
MARKER = "E2B_STANDIN_SANDBOX"  # in every stand-in process's environment: which sandbox it is in

# Go's names for signals, as envd's end event reports them ("signal: killed").
_GO_SIGNAL_NAMES = {signal.SIGKILL: "killed", signal.SIGTERM: "terminated"}


# == the stand-in ==============================================================================


@dataclass
class FakeSandbox:
    """One stand-in sandbox: a home folder and the processes started in it."""

    id: str
    template: str
    metadata: dict[str, str]
    envs: dict[str, str]
    timeout: int
    token: str
    home: Path
    started: datetime
    state: str = "running"
    procs: dict[int, asyncio.subprocess.Process] = field(default_factory=dict)

    @property
    def end(self) -> datetime:
        return self.started + timedelta(seconds=self.timeout)

    def listed(self) -> dict[str, Any]:
        """Its entry in ``GET /v2/sandboxes`` (the API's ListedSandbox)."""
        return {
            "templateID": self.template,
            "sandboxID": self.id,
            "clientID": "standin",
            "startedAt": self.started.isoformat(),
            "endAt": self.end.isoformat(),
            "cpuCount": 2,
            "memoryMB": 512,
            "diskSizeMB": 1024,
            "state": self.state,
            "envdVersion": ENVD_VERSION,
            "metadata": self.metadata,
        }


def _kill_marked(sandbox_id: str) -> None:
    """SIGKILL every process on this host whose environment carries ``sandbox_id``'s marker:
    what a VM's end does to everything in it, sessions of their own included."""
    needle = f"{MARKER}={sandbox_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)


def _end_event(returncode: int) -> process_pb.ProcessEvent.EndEvent:
    """envd's end event for a process's return code (Go's ``ProcessState`` semantics: a
    signal-ended process has exit code -1)."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        text = f"signal: {_GO_SIGNAL_NAMES.get(sig, sig.name.lower())}"
        return process_pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=text, error=text)
    status = f"exit status {returncode}"
    return process_pb.ProcessEvent.EndEvent(
        exit_code=returncode, exited=True, status=status, error=status if returncode else None
    )


def _is_dir(path: str) -> bool:
    return os.path.isdir(path)


def _oneof(kind: str, value: Any) -> Any:  # the generated types name each kind literally
    return Oneof(kind, value)


def _event(kind: str, value: Any) -> process_pb.StartResponse:
    return process_pb.StartResponse(event=process_pb.ProcessEvent(event=_oneof(kind, value)))


class StandInEnvd(Process):
    """envd's process service, for the stand-in: real local processes."""

    def __init__(self, standin: StandIn) -> None:
        self.standin = standin

    def _sandbox(self, ctx: Any) -> FakeSandbox:
        sbx = self.standin.live(ctx.request_headers.get("e2b-sandbox-id", ""))
        if sbx is None:  # the proxy answers first in StandIn.__call__; this is a backstop
            raise ConnectError(Code.UNAVAILABLE, "The sandbox was not found")
        return sbx

    def _proc(self, ctx: Any, selector: Any) -> asyncio.subprocess.Process:
        proc = self._sandbox(ctx).procs.get(selector.selector.value)
        if proc is None:
            raise ConnectError(Code.NOT_FOUND, f"process {selector.selector.value} not found")
        return proc

    async def start(self, request: Any, ctx: Any) -> AsyncIterator[process_pb.StartResponse]:
        sbx = self._sandbox(ctx)
        cfg = request.process
        cwd = cfg.cwd if cfg.has_field("cwd") and cfg.cwd else str(sbx.home)
        if not _is_dir(cwd):
            raise ConnectError(Code.INVALID_ARGUMENT, f"cwd '{cwd}' does not exist")
        self.standin.starts.append({"cmd": cfg.cmd, "args": list(cfg.args), "cwd": cfg.cwd})
        env = {"PATH": os.environ["PATH"], "HOME": str(sbx.home), MARKER: sbx.id}
        env |= sbx.envs | dict(cfg.envs)
        stdin = request.stdin if request.has_field("stdin") else True
        proc = await asyncio.create_subprocess_exec(
            cfg.cmd,
            *cfg.args,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=cwd,
        )
        sbx.procs[proc.pid] = proc
        if self.standin.hold_start is not None:
            await asyncio.to_thread(self.standin.hold_start.wait)
        # envd runs the process under a context with the stream's deadline: at the deadline
        # the direct process (only it) is SIGKILLed.
        deadline = ctx.timeout_ms
        killer = (
            asyncio.get_running_loop().call_later(deadline / 1000, proc.kill) if deadline else None
        )
        events: asyncio.Queue[process_pb.StartResponse | None] = asyncio.Queue()

        async def pump(stream: asyncio.StreamReader, kind: str) -> None:
            while chunk := await stream.read(32 * 1024):
                data = process_pb.ProcessEvent.DataEvent(output=_oneof(kind, chunk))
                events.put_nowait(_event("data", data))

        async def finish() -> None:
            assert proc.stdout is not None and proc.stderr is not None
            pumps = asyncio.gather(pump(proc.stdout, "stdout"), pump(proc.stderr, "stderr"))
            code = await proc.wait()
            # Like envd (Go's cmd.Wait closes the pipes at exit), output a grandchild writes
            # after the process ended is not waited for long.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pumps, 1.0)
            events.put_nowait(_event("end", _end_event(code)))
            events.put_nowait(None)

        finisher = asyncio.ensure_future(finish())
        try:
            yield _event("start", process_pb.ProcessEvent.StartEvent(pid=proc.pid))
            while (item := await events.get()) is not None:
                yield item
        finally:
            # A dropped stream leaves the process running (envd does not tie it to the
            # request); it is forgotten once it ends.
            def forget(_: Any) -> None:
                sbx.procs.pop(proc.pid, None)
                if killer is not None:
                    killer.cancel()

            finisher.add_done_callback(forget)

    async def send_input(self, request: Any, ctx: Any) -> process_pb.SendInputResponse:
        proc = self._proc(ctx, request.process)
        if proc.stdin is None or proc.stdin.is_closing():
            raise ConnectError(Code.FAILED_PRECONDITION, "stdin not enabled or closed")
        try:
            proc.stdin.write(request.input.input.value)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise ConnectError(Code.INTERNAL, f"error writing to stdin: {e}") from e
        return process_pb.SendInputResponse()

    async def send_signal(self, request: Any, ctx: Any) -> process_pb.SendSignalResponse:
        proc = self._proc(ctx, request.process)
        sig = signal.SIGKILL if request.signal == process_pb.Signal.SIGKILL else signal.SIGTERM
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        return process_pb.SendSignalResponse()

    async def close_stdin(self, request: Any, ctx: Any) -> process_pb.CloseStdinResponse:
        proc = self._proc(ctx, request.process)
        if proc.stdin is not None:
            proc.stdin.close()
        return process_pb.CloseStdinResponse()


class StandIn:
    """A stand-in of E2B's service (control plane, proxy and envd) as one ASGI app; test code
    (see the module docstring). State is touched from the server's thread and the test's."""

    url = ""  # where it is served, once it is

    def __init__(self, root: Path, *, templates: tuple[str, ...] = ("base", "corral-py")):
        self.root = root
        self.templates = set(templates)
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.creates: list[dict[str, Any]] = []  # each: {"body": ..., "headers": ...}
        self.kills: list[str] = []
        self.starts: list[dict[str, Any]] = []
        self.page_size = 2  # small, so that listing needs several pages
        self.idempotent: dict[str, str] = {}  # idempotency key -> sandbox id
        self.answer_next_with: int | None = None  # create the sandbox, then answer this error
        self.hold_create: threading.Event | None = None  # create, then wait for this to answer
        self.hold_start: threading.Event | None = None  # start a process, then wait to say so
        self.created = threading.Event()
        self._ids = itertools.count(1)
        self._envd = ProcessASGIApplication(StandInEnvd(self))
        self._rest = Starlette(
            routes=[
                Route("/v2/sandboxes", self._create, methods=["POST"]),
                Route("/v2/sandboxes", self._list, methods=["GET"]),
                Route("/sandboxes/{sandbox_id}", self._delete, methods=["DELETE"]),
                Route("/files", self._read, methods=["GET"]),
                Route("/files", self._write, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    # -- state ----------------------------------------------------------------------------------

    def live(self, sandbox_id: str) -> FakeSandbox | None:
        sbx = self.sandboxes.get(sandbox_id)
        if sbx is not None and datetime.now(UTC) > sbx.end:  # its time to live ran out
            self.kill_now(sandbox_id)
            return None
        return sbx

    def add(
        self,
        template: str,
        metadata: dict[str, str],
        *,
        envs: dict[str, str] | None = None,
        timeout: int = 300,
        state: str = "running",
    ) -> FakeSandbox:
        """A new sandbox (also how tests seed sandboxes that other servers made)."""
        sid = f"sbx{next(self._ids):04d}{secrets.token_hex(3)}"
        home = self.root / sid / "home"
        home.mkdir(parents=True)
        sbx = FakeSandbox(
            sid,
            template,
            dict(metadata),
            dict(envs or {}),
            timeout,
            secrets.token_hex(8),
            home,
            datetime.now(UTC),
            state,
        )
        self.sandboxes[sid] = sbx
        return sbx

    def kill_now(self, sandbox_id: str) -> bool:
        """End a sandbox as E2B does: every process in it dies. False if there was none."""
        sbx = self.sandboxes.pop(sandbox_id, None)
        if sbx is None:
            return False
        _kill_marked(sandbox_id)
        return True

    def alive_ids(self) -> set[str]:
        return {sid for sid in list(self.sandboxes) if self.live(sid) is not None}

    # -- the control plane ----------------------------------------------------------------------

    @staticmethod
    def _error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"code": status, "message": message}, status_code=status)

    def _authorized(self, request: Request) -> bool:
        return request.headers.get("x-api-key") == API_KEY

    async def _create(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._error(401, "Invalid API key")
        body = await request.json()
        key = request.headers.get("idempotency-key")
        self.creates.append({"body": body, "headers": dict(request.headers)})
        if key in self.idempotent:
            sbx = self.sandboxes[self.idempotent[key]]
        else:
            if body["templateID"] not in self.templates:
                return self._error(404, f"template '{body['templateID']}' not found")
            sbx = self.add(
                body["templateID"],
                body.get("metadata", {}),
                envs=body.get("envVars", {}),
                timeout=body.get("timeout", 300),
            )
            if key:
                self.idempotent[key] = sbx.id
        self.created.set()
        if self.hold_create is not None:
            await asyncio.to_thread(self.hold_create.wait)
        if (status := self.answer_next_with) is not None:
            self.answer_next_with = None
            response = self._error(status, "the answer got lost")
            response.headers["Retry-After"] = "0"  # for the SDK's retry of a 503, at once
            return response
        return JSONResponse(
            {
                "templateID": sbx.template,
                "sandboxID": sbx.id,
                "clientID": "standin",
                "envdVersion": ENVD_VERSION,
                "envdAccessToken": sbx.token,
            },
            status_code=201,
        )

    async def _list(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._error(401, "Invalid API key")
        wanted: dict[str, str] = {}
        if raw := request.query_params.get("metadata"):
            pairs = urllib.parse.parse_qsl(raw)
            wanted = {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}
        states = set(filter(None, request.query_params.get("state", "").split(",")))
        found = [
            sbx
            for sid in sorted(self.alive_ids())
            if (sbx := self.sandboxes[sid])
            and all(sbx.metadata.get(k) == v for k, v in wanted.items())
            and (not states or sbx.state in states)
        ]
        limit = min(int(request.query_params.get("limit", 100)), self.page_size)
        offset = int(request.query_params.get("nextToken", 0))
        page = found[offset : offset + limit]
        headers = {}
        if offset + limit < len(found):
            headers["x-next-token"] = str(offset + limit)
        return JSONResponse([sbx.listed() for sbx in page], headers=headers)

    async def _delete(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._error(401, "Invalid API key")
        sid = request.path_params["sandbox_id"]
        self.kills.append(sid)
        if self.live(sid) is None or not self.kill_now(sid):
            return self._error(404, f"sandbox {sid} not found")
        return Response(status_code=204)

    # -- envd's HTTP API ------------------------------------------------------------------------

    def _path(self, request: Request) -> Path:
        sbx = self.sandboxes[request.headers["e2b-sandbox-id"]]
        path = Path(request.query_params["path"])
        return path if path.is_absolute() else sbx.home / path

    async def _read(self, request: Request) -> Response:
        path = self._path(request)
        if not path.is_file():
            return self._error(404, f"path '{path}' does not exist")
        return Response(path.read_bytes(), media_type="application/octet-stream")

    async def _write(self, request: Request) -> Response:
        if request.headers.get("content-type") != "application/octet-stream":
            return self._error(400, "this stand-in takes application/octet-stream uploads only")
        path = self._path(request)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(await request.body())
        return JSONResponse([{"name": path.name, "type": "file", "path": str(path)}])

    async def _health(self, request: Request) -> Response:
        return Response(status_code=204)

    # -- routing: E2B's proxy in front of envd --------------------------------------------------

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (
            path.startswith("/process.Process/") or path in ("/files", "/health")
        ):
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            sbx = self.live(headers.get("e2b-sandbox-id", ""))
            if sbx is None:
                msg = f"The sandbox {headers.get('e2b-sandbox-id')} was not found"
                await self._error(502, msg)(scope, receive, send)
                return
            if headers.get("x-access-token") != sbx.token:
                await self._error(401, "bad envd access token")(scope, receive, send)
                return
            if path.startswith("/process.Process/"):
                await self._envd(scope, receive, send)
                return
        await self._rest(scope, receive, send)


# == fixtures ==================================================================================


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandIn]:
    service = StandIn(tmp_path / "e2b")
    with serve(service) as url:
        service.url = url
        try:
            yield service
        finally:  # what a test left running ends before the server stops
            for sid in list(service.sandboxes):
                service.kill_now(sid)


def make_provider(standin: StandIn, **kw: Any) -> E2BProvider:
    # uvicorn speaks HTTP/1.1 only; the SDK's default is HTTP/2.
    params = {"api_url": standin.url, "sandbox_url": standin.url, "http_version": "1.1"}
    kw.setdefault("api_key", API_KEY)
    # Its "sandboxes" share this host's /tmp: keep their bookkeeping in the test's folder.
    kw.setdefault("state_dir", str(standin.root / "state"))
    return E2BProvider("test-owner", api_params=params, **kw)


@pytest.fixture
def provider(standin: StandIn) -> E2BProvider:
    return make_provider(standin)


@pytest.fixture
def spec(tmp_path: Path) -> SandboxSpec:
    return SandboxSpec(workdir=str(tmp_path / "work"), ttl_s=600)


@pytest.fixture
async def sandbox(provider: E2BProvider, spec: SandboxSpec) -> AsyncIterator[E2BSandbox]:
    sbx = await provider.create(spec)
    yield sbx
    await sbx.close()


def _read_int(path: Path) -> int:
    return int(path.read_text())


def _dead(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def _until(predicate: Any, what: str, within: float = 10.0) -> None:
    """Poll ``predicate`` until true (SIGKILL delivery is asynchronous); fail after
    ``within`` s saying ``what`` was expected."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.02)


# == create: what goes to E2B ==================================================================


async def test_create_sends_template_ttl_metadata_env_and_network(
    standin: StandIn, provider: E2BProvider, tmp_path: Path
) -> None:
    spec = SandboxSpec(
        image="corral-py",
        workdir=str(tmp_path / "work"),
        env={"A": "1"},
        ttl_s=90.2,
        labels={"bundle": "gridsim", OWNER_LABEL: "spoofed"},
    )
    before = time.time()
    sbx = await provider.create(spec)
    try:
        [call] = standin.creates
        body, headers = call["body"], call["headers"]
        assert sbx.id in standin.sandboxes and sbx.name.startswith("corral-")
        assert body["templateID"] == "corral-py"
        assert body["timeout"] == 91  # rounded up: E2B takes whole seconds
        assert body["envVars"] == {"A": "1"}
        assert body["allow_internet_access"] is False  # (the API spells this one so)
        assert body["network"] == {"allowPublicTraffic": False}
        assert body["autoPause"] is False  # lifecycle on_timeout: kill, not pause
        assert headers["idempotency-key"] == sbx.name
        assert headers["x-api-key"] == API_KEY
        meta = body["metadata"]
        pid = os.getpid()
        assert meta[OWNER_LABEL] == "test-owner"  # the spec's label cannot spoof the owner
        assert meta[SANDBOX_LABEL] == sbx.name
        assert meta["bundle"] == "gridsim"
        assert meta[ownership.HOST_LABEL] == socket.gethostname()
        assert meta[ownership.PID_LABEL] == str(pid)
        assert meta[ownership.START_LABEL] == str(process_start_time(pid))
        assert meta[ownership.BOOT_LABEL] == ownership.boot_id()
        expires = float(meta[ownership.EXPIRES_LABEL])  # written with 3 decimals
        assert before + 90.2 - 0.001 <= expires <= time.time() + 90.2 + 0.001
        # The working folder was made (as root, sticky and world-writable) by a command.
        assert (tmp_path / "work").is_dir()
        assert (tmp_path / "work").stat().st_mode & 0o7777 == 0o1777
        assert standin.starts[0]["args"][-1].startswith("[ -d ")
    finally:
        await sbx.close()


async def test_default_template_and_no_or_too_long_ttl(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec
) -> None:
    await (await provider.create(spec.model_copy(update={"ttl_s": None}))).close()
    await (await provider.create(spec.model_copy(update={"ttl_s": 10 * 86400.0}))).close()
    unlimited, too_long = (c["body"] for c in standin.creates)
    assert unlimited["templateID"] == "base"
    assert unlimited["timeout"] == backend.MAX_TTL_S  # no time to live: E2B's longest
    assert ownership.EXPIRES_LABEL not in unlimited["metadata"]
    assert too_long["timeout"] == backend.MAX_TTL_S  # cut to what E2B allows, label too
    expires = float(too_long["metadata"][ownership.EXPIRES_LABEL])
    assert abs(expires - (time.time() + backend.MAX_TTL_S)) < 60


async def test_allowlist_becomes_allow_out_with_everything_else_denied(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec
) -> None:
    policy = NetworkPolicy(mode="allowlist", allow=("pypi.org", "10.1.2.0/24"))
    sbx = await provider.create(spec.model_copy(update={"network": policy}))
    await sbx.close()
    body = standin.creates[0]["body"]
    assert body["network"] == {
        "allowOut": ["pypi.org", "10.1.2.0/24"],
        "denyOut": ["0.0.0.0/0"],
        "allowPublicTraffic": False,
    }
    assert "allow_internet_access" not in body


async def test_ports_private_by_default_public_when_asked(
    standin: StandIn, spec: SandboxSpec
) -> None:
    private = await make_provider(standin).create(spec)
    with pytest.raises(SandboxError, match="ports private"):
        await private.endpoint(8080)
    await private.close()
    public = await make_provider(standin, public_endpoints=True).create(spec)
    assert await public.endpoint(8080) == Endpoint(f"8080-{public.id}.e2b.app", 443)
    await public.close()
    assert [c["body"]["network"]["allowPublicTraffic"] for c in standin.creates] == [False, True]


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"binds": (Bind(source=Path("/etc"), target="/host-etc"),)}, "cannot mount host paths"),
        ({"rootfs": Path("/srv/rootfs")}, "spec.rootfs is for bwrap"),
        ({"network": NetworkPolicy(mode="loopback", server_port=8000)}, "does not exist"),
        ({"network": NetworkPolicy(mode="allowlist", allow=("pypi.org:443",))}, "not ports"),
        ({"network": NetworkPolicy(mode="allowlist", allow=("https://x.org",))}, "not ports"),
    ],
)
async def test_refused_specs_make_nothing(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec, update: dict[str, Any], message: str
) -> None:
    with pytest.raises(SandboxError, match=message):
        await provider.create(spec.model_copy(update=update))
    assert standin.creates == [] and standin.sandboxes == {}


async def test_limits_are_warned_about_once_not_sent(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec, caplog: pytest.LogCaptureFixture
) -> None:
    limited = spec.model_copy(update={"cpus": 2.0, "memory_mb": 512})
    with caplog.at_level(logging.WARNING, logger="corral.sandboxes.e2b"):
        for _ in range(2):
            await (await provider.create(limited)).close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cpus, memory_mb are not applied" in warnings[0]
    sent = set(standin.creates[0]["body"])
    assert sent == {
        "templateID",
        "timeout",
        "metadata",
        "envVars",
        "allow_internet_access",
        "network",
        "autoPause",
    }


# == create: failures ==========================================================================


async def test_unknown_template_is_a_sandbox_error(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec
) -> None:
    with pytest.raises(SandboxError, match="template 'nope' not found"):
        await provider.create(spec.model_copy(update={"image": "nope"}))
    assert standin.sandboxes == {}


async def test_lost_create_answer_leaves_nothing(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec
) -> None:
    standin.answer_next_with = 500  # the sandbox is made, its answer lost
    with pytest.raises(SandboxError, match="could not be created"):
        await provider.create(spec)
    assert len(standin.creates) == 1  # a 500 is not retried by the SDK
    assert standin.alive_ids() == set()
    assert len(standin.kills) == 1  # found by its corral.sandbox label and killed


async def test_a_retried_create_makes_one_sandbox(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec
) -> None:
    standin.answer_next_with = 503  # made, then "busy": the SDK retries the request
    sbx = await provider.create(spec)
    keys = [c["headers"]["idempotency-key"] for c in standin.creates]
    assert keys == [sbx.name, sbx.name]  # the same key twice: E2B answers with the same one
    assert standin.alive_ids() == {sbx.id}
    await sbx.close()


async def test_a_failed_setup_kills_the_new_sandbox(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec
) -> None:
    with pytest.raises(SandboxError, match="cannot create the working folder /proc/nope"):
        await provider.create(spec.model_copy(update={"workdir": "/proc/nope"}))
    assert len(standin.kills) == 1 and standin.alive_ids() == set()


async def test_cancelled_create_leaves_nothing(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec
) -> None:
    standin.hold_create = threading.Event()
    task = asyncio.ensure_future(provider.create(spec))
    try:
        await asyncio.to_thread(standin.created.wait, 10)
        assert len(standin.alive_ids()) == 1  # made; its answer is held back
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert standin.alive_ids() == set()
    finally:
        standin.hold_create.set()


async def test_bad_or_missing_api_key(
    standin: StandIn, spec: SandboxSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SandboxError, match="Invalid API key"):
        await make_provider(standin, api_key="e2b_wrong").create(spec)
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(SandboxError, match="set E2B_API_KEY"):
        await make_provider(standin, api_key=None).create(spec)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)  # the environment's key is used
    await (await make_provider(standin, api_key=None).create(spec)).close()
    assert standin.creates[-1]["headers"]["x-api-key"] == API_KEY


async def test_missing_sdk_says_how_to_install(
    standin: StandIn, spec: SandboxSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "e2b", None)  # what an absent package looks like to import
    with pytest.raises(SandboxError, match=r"pip install 'corral\[e2b\]'"):
        await make_provider(standin).create(spec)


async def test_too_old_sdk_is_refused_by_signature(standin: StandIn, spec: SandboxSpec) -> None:
    class OldSandbox(e2b.AsyncSandbox):
        """An SDK before network rules, lifecycle and idempotency keys (e2b 2.0's create)."""

        @classmethod
        async def create(  # type: ignore[override]
            cls,
            template: str | None = None,
            timeout: int | None = None,  # noqa: ASYNC109
            metadata: dict[str, str] | None = None,
            envs: dict[str, str] | None = None,
            secure: bool | None = True,
            allow_internet_access: bool = True,
            **opts: Any,
        ) -> Any:
            raise AssertionError("never called")

    with pytest.raises(SandboxError, match="lacks idempotency_key, lifecycle, network"):
        await make_provider(standin, sdk=OldSandbox).create(spec)
    assert standin.creates == []


def test_installed_sdk_takes_every_keyword_the_backend_passes() -> None:
    assert backend.missing_keywords(e2b, e2b.AsyncSandbox) == {}


# == exec ======================================================================================


async def test_exec_exit_code_and_output(sandbox: E2BSandbox) -> None:
    res = await sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=30)
    assert (res.exit_code, res.stdout, res.stderr) == (3, "out\n", "err\n")
    assert not res.timed_out and res.reason is None
    ok = await sandbox.exec(["true"], timeout=30)
    assert ok.exit_code == 0 and not ok.timed_out
    missing = await sandbox.exec(["no-such-command-xyz"], timeout=30)
    assert missing.exit_code == 127


async def test_exec_env_cwd_and_binary_stdin(
    standin: StandIn, provider: E2BProvider, tmp_path: Path
) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "greet").write_text('#!/bin/sh\necho "hi $WHO from $(pwd)"\n')
    (tools / "greet").chmod(0o755)
    work = tmp_path / "work"
    spec = SandboxSpec(workdir=str(work), env={"WHO": "spec"}, ttl_s=600)
    async with await provider.create(spec) as sbx:
        await sbx.write_file("sub/.keep", b"")
        # PATH survives envd's `bash -l` (whose login profile resets it) and WHO the exec's.
        env = {"PATH": f"{tools}:/usr/bin:/bin", "WHO": "exec"}
        res = await sbx.exec(["greet"], timeout=30, env=env, cwd="sub")
        assert res.stdout == f"hi exec from {work / 'sub'}\n", res.stderr
        blob = bytes(range(256)) * 300
        res = await sbx.exec(["sha256sum"], timeout=30, stdin=blob)
        assert res.stdout.split()[0] == hashlib.sha256(blob).hexdigest()
        # Without stdin a reader sees EOF at once rather than waiting for input.
        assert (await sbx.exec(["cat"], timeout=30)).stdout == ""
        with pytest.raises(SandboxError, match="does not exist"):
            await sbx.exec(["true"], timeout=30, cwd="/nonexistent/dir")
    assert list((standin.root / "state").iterdir()) == []  # no session or stdin file left


async def test_exec_timeout_kills_the_whole_session(
    standin: StandIn, sandbox: E2BSandbox, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    # One child stays in timeout's process group; one moves to a group of its own (out of
    # timeout's reach); both are in the exec's session.
    regroup = "import os, time; os.setpgid(0, 0); time.sleep(60)"
    script = (
        f"sleep 60 & echo $! > {pids}.a; "
        f"{shlex.quote(sys.executable)} -c {shlex.quote(regroup)} & echo $! > {pids}.b; wait"
    )
    started = time.monotonic()
    res = await sandbox.exec(["sh", "-c", script], timeout=1)
    assert res.timed_out and res.reason == "timeout"
    assert res.exit_code in (124, 137)
    assert time.monotonic() - started < 1 + 1 + shell.HOST_GRACE_S
    children = [_read_int(Path(f"{pids}.{x}")) for x in "ab"]
    await _until(lambda: all(_dead(p) for p in children), "both children SIGKILLed")
    assert list((standin.root / "state").iterdir()) == []  # its session file is removed


async def test_a_cancelled_exec_kills_its_command(
    standin: StandIn, sandbox: E2BSandbox, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    task = asyncio.ensure_future(
        sandbox.exec(
            ["sh", "-c", f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; sleep 60"],
            timeout=60,
        )
    )
    await _until(pidfile.exists, "the command started")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pid = _read_int(pidfile)
    await _until(lambda: _dead(pid), "the cancelled exec's command SIGKILLed")
    assert list((standin.root / "state").iterdir()) == []


@pytest.mark.parametrize("how", ["exec", "spawn"])
async def test_cancelled_while_starting_still_kills_the_command(
    standin: StandIn, sandbox: E2BSandbox, tmp_path: Path, how: str
) -> None:
    pidfile = tmp_path / "pid"
    cmd = ["sh", "-c", f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; sleep 60"]
    standin.hold_start = threading.Event()  # the process runs; envd's answer is held back
    call = sandbox.exec(cmd, timeout=60) if how == "exec" else sandbox.spawn(cmd)
    task = asyncio.ensure_future(call)
    try:
        await _until(pidfile.exists, "the command started")
        task.cancel()
        standin.hold_start.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        standin.hold_start.set()
    pid = _read_int(pidfile)
    await _until(lambda: _dead(pid), "the command whose start was cancelled SIGKILLed")


async def test_exec_host_kills_what_the_sandbox_timeout_could_not(
    standin: StandIn, sandbox: E2BSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shell, "HOST_GRACE_S", 0.5)
    state = standin.root / "state"
    pidfile = tmp_path / "pid"
    # The command stops its parent, `timeout`, so the in-sandbox deadline never fires.
    script = f"echo $$ > {pidfile}; kill -STOP $PPID; sleep 60"
    started = time.monotonic()
    res = await sandbox.exec(["sh", "-c", script], timeout=0.5)
    assert res.timed_out and res.exit_code == 137
    assert time.monotonic() - started < 0.5 + 1 + 0.5 + backend.KILL_WAIT_S
    pid = _read_int(pidfile)
    await _until(lambda: _dead(pid), "the stopped command's session SIGKILLed by the host")
    assert list(state.iterdir()) == []  # the host-side kill removed the session file


# == spawn =====================================================================================

ECHO = """
import subprocess, sys
child = subprocess.Popen(["sleep", "60"])
print("child", child.pid, flush=True)
for line in sys.stdin:
    if line.strip() == "quit":
        break
    sys.stdout.write("echo " + line)
    sys.stdout.flush()
print("bye from stderr", file=sys.stderr, flush=True)
child.kill()
"""


async def test_spawn_speaks_lines_over_stdin_and_stdout(sandbox: E2BSandbox) -> None:
    proc = await sandbox.spawn([sys.executable, "-u", "-c", ECHO])
    assert (await proc.readline()).startswith(b"child ")
    await proc.write(b'{"n": 1}\n')
    assert await proc.readline() == b'echo {"n": 1}\n'
    await proc.write("é\n".encode())
    assert await proc.readline() == "echo é\n".encode()
    await proc.write(b"quit\n")
    assert await proc.readline() == b""  # exited: EOF
    assert await proc.readline() == b""
    assert "bye from stderr" in proc.stderr_tail()
    with pytest.raises(SandboxError, match="exited"):
        await proc.write(b"late\n")
    await proc.kill()  # after its exit: a no-op that does not raise


async def test_spawn_last_line_without_newline_and_overlong_lines(
    sandbox: E2BSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = await sandbox.spawn(["printf", "a\\nb"])
    assert [await proc.readline() for _ in range(3)] == [b"a\n", b"b", b""]
    monkeypatch.setattr(backend, "MAX_LINE", 1000)
    proc = await sandbox.spawn(["sh", "-c", "head -c 5000 /dev/zero | tr '\\0' x"])
    with pytest.raises(SandboxError, match="over 1000 bytes"):
        while await proc.readline():
            pass


async def test_spawn_in_a_missing_folder_is_a_sandbox_error(sandbox: E2BSandbox) -> None:
    with pytest.raises(SandboxError, match="does not exist"):
        await sandbox.spawn(["true"], cwd="/nonexistent/dir")


# == files, liveness, close ====================================================================


async def test_files_round_trip_and_missing_file(sandbox: E2BSandbox, tmp_path: Path) -> None:
    blob = bytes(range(256)) * 40
    await sandbox.write_file("deep/er/blob.bin", blob)
    assert (tmp_path / "work" / "deep" / "er" / "blob.bin").read_bytes() == blob
    assert await sandbox.read_file(str(tmp_path / "work" / "deep/er/blob.bin")) == blob
    with pytest.raises(SandboxError, match="does not exist"):
        await sandbox.read_file("missing.txt")


async def test_close_kills_everything_and_is_idempotent(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec
) -> None:
    sbx = await provider.create(spec)
    proc = await sbx.spawn([sys.executable, "-u", "-c", ECHO])
    child = int((await proc.readline()).split()[1])
    assert await sbx.is_alive()
    await sbx.close()
    await sbx.close()
    assert standin.kills == [sbx.id] and sbx.id not in standin.sandboxes
    assert not await sbx.is_alive()
    await _until(lambda: _dead(child), "the sandbox's processes killed with it")
    with pytest.raises(SandboxError, match="closed"):
        await sbx.exec(["true"], timeout=5)


async def test_a_sandbox_gone_under_us(standin: StandIn, sandbox: E2BSandbox) -> None:
    standin.kill_now(sandbox.id)  # E2B ended it (time to live, quota, an operator)
    assert await sandbox.is_alive() is False
    with pytest.raises(SandboxError, match=r"not found|killed"):
        await sandbox.exec(["true"], timeout=5)
    with pytest.raises(SandboxError):
        await sandbox.read_file("x")
    await sandbox.close()  # killing what is already gone is fine


# == listing and sweeping ======================================================================


async def test_list_owned_by_owner_label_across_pages(
    standin: StandIn, provider: E2BProvider, spec: SandboxSpec
) -> None:
    mine = [await provider.create(spec) for _ in range(3)]
    other = standin.add("base", {OWNER_LABEL: "someone-else"})
    paused = standin.add("base", {OWNER_LABEL: "test-owner"}, state="paused")
    assert await provider.list_owned() == sorted(s.id for s in mine)  # 2 per page here
    assert other.id in standin.alive_ids() and paused.id in standin.alive_ids()
    for s in mine:
        await s.close()
    assert await provider.list_owned() == []


def _exited_pid() -> tuple[int, int | None]:
    """A pid (and its start time) of a process that has exited: a dead owner."""
    proc = subprocess.Popen(["true"])
    start = process_start_time(proc.pid)
    proc.wait()
    return proc.pid, start


async def test_sweep_kills_dead_owners_and_expired_only(
    standin: StandIn, provider: E2BProvider
) -> None:
    me = ownership.owner_labels(None)
    dead_pid, dead_start = _exited_pid()
    dead = me | {ownership.PID_LABEL: str(dead_pid), ownership.START_LABEL: str(dead_start)}
    past, future = f"{time.time() - 60:.3f}", f"{time.time() + 3600:.3f}"
    seeded = {
        "dead owner": dead | {OWNER_LABEL: "crashed"},
        "dead owner, paused": dead | {OWNER_LABEL: "crashed"},
        "host rebooted": me | {OWNER_LABEL: "x", ownership.BOOT_LABEL: "another-boot"},
        "pid reused": me | {OWNER_LABEL: "x", ownership.START_LABEL: "1"},
        "expired": me | {OWNER_LABEL: "test-owner", ownership.EXPIRES_LABEL: past},
        "live owner": me | {OWNER_LABEL: "test-owner", ownership.EXPIRES_LABEL: future},
        "other host": dead | {OWNER_LABEL: "x", ownership.HOST_LABEL: "elsewhere"},
        "not corral's": {ownership.PID_LABEL: str(dead_pid)},
    }
    ids = {
        what: standin.add("base", meta, state="paused" if "paused" in what else "running").id
        for what, meta in seeded.items()
    }
    swept = await provider.sweep()
    gone = {"dead owner", "dead owner, paused", "host rebooted", "pid reused", "expired"}
    assert swept == sorted(ids[w] for w in gone)
    assert standin.alive_ids() == {ids[w] for w in seeded if w not in gone}
    assert await provider.sweep() == []


async def test_a_bundle_env_runs_in_an_e2b_sandbox(provider: E2BProvider, tmp_path: Path) -> None:
    """The env server's path into E2B: the runner and bundle uploaded (no host binds), the env
    driven over a background command's stdin/stdout, graded like in-process. (The stand-in runs
    commands on this host, so the work and upload folders are temporary ones here.)"""
    from corral.envs.bundle import load_bundle
    from corral.envs.hosting import SandboxHost

    bundle = load_bundle(GRIDSIM)
    spec = SandboxSpec(workdir=str(tmp_path / "work"), ttl_s=600)
    host = SandboxHost(bundle, provider, spec, upload_root=str(tmp_path / "code"))
    await host.open()
    try:
        env = await host.start()
        try:
            task = bundle.task("eval", 0)
            assert await env.reset(task) == task.prompt
            out = await env.call_tool("submit_schedule", {"schedule": [0] * 24})
            assert out.done and not out.error
            assert bundle.reward(bundle.grade(task, await env.state())) == pytest.approx(0.2)
        finally:
            await env.close()
    finally:
        await host.aclose()
    assert await provider.list_owned() == []
    assert (tmp_path / "code" / "corral" / "envs" / "runner.py").is_file()
    assert not (tmp_path / "code" / "bundle" / "tasks" / "eval.jsonl").exists()
