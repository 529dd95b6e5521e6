"""The ``docker`` backend: one container per sandbox, from the image :mod:`.image` builds.

What each container gets (``DockerProvider.create``):

- the image (default ``corral-sandbox:py3``), ``docker-init`` (tini) as PID 1 reaping orphans,
  and a keeper ``sleep <ttl_s>``: the container stops by itself once its time to live is over,
  even when no sweep runs; a stopped container is removed by the next :meth:`sweep`;
- network ``none`` (policy ``none``): no interface but ``lo``; the host's loopback and every other
  address are unreachable. The env server talks to code inside through :meth:`DockerSandbox.exec`
  (and files); :meth:`DockerSandbox.endpoint` refuses with network ``none``;
- policy ``loopback`` is refused unless the provider was made with ``allow_host_network=True``:
  then the container shares the *host's* network namespace (``network_mode="host"``), which
  exposes **every** host port and interface to the sandbox, not only the env server's port.
  Use it for trusted code only. ``allowlist`` is refused (no enforcement here);
- limits: ``memory_mb`` (default 1024; swap off: ``memswap_limit`` equal), ``cpus`` (default 1.0,
  ``nano_cpus``), ``pids`` (default 256), read-only root, ``/tmp`` a 64 MiB tmpfs, the working
  folder a tmpfs-backed volume of ``disk_mb`` (default 256) so that files can be copied in and
  out with ``put_archive``/``get_archive`` even with the read-only root;
- user 1000:1000 for :meth:`DockerSandbox.exec` and files, ``cap_drop=["ALL"]`` but
  :data:`RUNNER_CAPS`, ``security_opt=["no-new-privileges"]``, its own pid/ipc/uts namespaces
  (docker's default), no host bind unless ``spec.binds`` asks (read-only unless ``writable``);
- :meth:`DockerSandbox.spawn` (the env's runner) as uid :data:`RUNNER_UID` (999) holding
  only :data:`RUNNER_CAPS`, as ambient capabilities (``setpriv`` from root):
  ``SETUID``/``SETGID`` to start model actions as uid 1000 (:meth:`DockerProvider.model_jail`:
  ``setpriv`` again, leaving no capability), ``DAC_OVERRIDE`` to read its code (a host bind
  whose files are the server's user's only) and the model's files in the working folder
  whatever their modes. A process of uid 1000 with no capabilities cannot signal, trace or
  read (``/proc/<pid>/mem``, ``environ``, ``fd/``) a process of another uid, nor read
  owner-only files it does not own; docker's seccomp profile refuses the nested user
  namespaces that would give it capabilities, and ``no-new-privileges`` makes setuid binaries
  and file capabilities inert. The container's configured user is root, with only
  :data:`RUNNER_CAPS` in its bounding set: docker empties the permitted set of every exec of a
  container whose configured user is not root, whatever user the exec asks for, so the runner
  could not get its capabilities otherwise. Every exec but spawn's names uid 1000;
- labels: ``corral.owner``, ``corral.sandbox`` (the name, chosen before the create call), the
  owner's host, boot id, pid and process start time, the expiry time, and ``spec.labels``.
  Labels are set atomically with the create call, so a server that crashes between "create
  requested" and "create answered" leaves a labelled container that :meth:`sweep` removes.

Exec follows :mod:`corral.sandboxes.shell`: a docker exec leads a session of its own, whose id
the wrapper writes down; inside, ``timeout --kill-after=1`` signals the command's whole process
group; then (or when the exec has not returned ``timeout + 4`` s later, or its caller was
cancelled) the host kills every process of the exec's session (``pkill -KILL -s``), which also
ends children that moved to a process group of their own. A process that leaves the session
(``setsid``) escapes the session kill but still dies with the container at ``close``.

Not enforced: ``disk_mb`` outside the working folder (the root is read-only, ``/tmp`` is capped at
64 MiB), egress policies other than ``none``, seccomp beyond docker's default profile.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import logging
import os
import re
import shlex
import tarfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import PurePosixPath
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
    setpriv_jail,
)
from corral.sandboxes.cgroups import event_count
from corral.sandboxes.image import DEFAULT_TAG
from corral.sandboxes.ownership import expired, owner_gone, owner_labels
from corral.sandboxes.streams import LineBuffer

log = logging.getLogger(__name__)

DEFAULT_MEMORY_MB = 1024
DEFAULT_CPUS = 1.0
DEFAULT_PIDS = 256
DEFAULT_DISK_MB = 256
TMP_MB = 64
UID = 1000  # the unprivileged user exec, files and model actions run as
EXEC_USER = f"{UID}:{UID}"  # exec, file transfers through exec, the bookkeeping
RUNNER_USER = "0:0"  # the container's own user, and spawn's until it becomes RUNNER_UID
RUNNER_UID = 999  # spawn (the env's runner): neither root nor the model's uid
RUNNER_CAPS = ("SETUID", "SETGID", "DAC_OVERRIDE")
# spawn's command goes from root to RUNNER_UID keeping only RUNNER_CAPS, as ambient
# capabilities (so that they survive the exec of python, which has no file capabilities).
_CAPS = ",".join(f"+{c.lower()}" for c in RUNNER_CAPS)
_RUNNER_SETPRIV = (
    "setpriv",
    f"--reuid={RUNNER_UID}",
    f"--regid={RUNNER_UID}",
    "--clear-groups",
    f"--inh-caps={_CAPS}",
    f"--ambient-caps={_CAPS}",
    "--",
)
KILL_WAIT_S = 10.0  # how long a killed exec may take to answer
_RUNNER_STATE_DIR = "/tmp/.corral-runner"  # spawn's, root's only: model actions cannot forge it


def _client() -> Any:
    """A client of the daemon at ``DOCKER_HOST`` (or the default socket). :class:`SandboxError`,
    one line, when none answers: ``from_env`` already asks the daemon for its API version, and
    its ``DockerException`` (wrapping urllib3's wrapping of the socket error) would otherwise
    reach the server's start-up as a 100-line chained traceback."""
    import docker
    import docker.errors

    try:
        # No per-request read timeout: an exec's output arrives when the command ends.
        return docker.from_env(timeout=24 * 3600)
    except docker.errors.DockerException as e:
        where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        raise SandboxError(
            f"no docker daemon answers at {where}: {e} (start dockerd, or set DOCKER_HOST)"
        ) from None


class DockerSandbox(Sandbox):
    """One container. Files under the working folder move with ``put_archive``/``get_archive``;
    other paths (``/tmp``) through exec."""

    def __init__(
        self, client: Any, container: Any, name: str, spec: SandboxSpec, *, host_net: bool
    ):
        self.id = name
        self._client = client
        self._container = container
        self._spec = spec
        self._host_net = host_net
        self._oom_seen = 0
        self._pids_seen = 0

    # -- exec ---------------------------------------------------------------------------------

    async def _raw(self, cmd: list[str], **kw: Any) -> tuple[int, bytes, bytes]:
        kw.setdefault("user", EXEC_USER)

        def run() -> tuple[int, bytes, bytes]:
            res = self._container.exec_run(cmd, demux=True, **kw)
            out, err = res.output if res.output else (None, None)
            return int(res.exit_code if res.exit_code is not None else -1), out or b"", err or b""

        try:
            return await asyncio.to_thread(run)
        except Exception as e:
            raise SandboxError(f"docker sandbox {self.id}: exec failed: {e}") from e

    async def _counters(self) -> tuple[int, int]:
        """(oom kills, pids-limit hits) of the container's cgroups so far (v1 or v2 layout)."""
        script = (
            "cat /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events "
            "/sys/fs/cgroup/pids/pids.events /sys/fs/cgroup/pids.events 2>/dev/null; true"
        )
        try:
            _, out, _ = await self._raw(["sh", "-c", script])
        except SandboxError:
            return self._oom_seen, self._pids_seen
        text = out.decode(errors="replace")
        return event_count(text, "oom_kill"), event_count(text, "max")

    async def exec(
        self,
        cmd: Sequence[str],
        *,
        timeout: float,  # noqa: ASYNC109 -- the deadline that kills the process tree inside
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        if not cmd:
            raise ValueError("exec needs a command")
        files = shell.SessionFiles.new(stdin=stdin is not None)
        if stdin is not None and files.stdin:
            await self._write_via_exec(files.stdin, stdin)
        t = shell.inner_timeout(timeout)
        started = time.monotonic()
        task = asyncio.ensure_future(
            self._raw(
                shell.docker_exec_argv(cmd, files, t),
                environment=dict(env or {}),
                workdir=cwd or self._spec.workdir,
            )
        )

        async def kill() -> None:
            await self._kill_session(shell.kill_line(files.sid), EXEC_USER)

        try:
            (code, out, err), host_killed = await shell.wait_or_kill(
                task,
                deadline=shell.host_deadline(t),
                kill=kill,
                kill_wait=KILL_WAIT_S,
                drop=task.cancel,
                lost=(137, b"", b""),
            )
            elapsed = time.monotonic() - started
            timed_out = shell.timed_out(code, elapsed, t, host_killed=host_killed)
            if timed_out and not host_killed:
                # What left timeout's process group (setpgid) is still in the session: kill it.
                await kill()
        finally:
            with contextlib.suppress(SandboxError):
                await self._raw(["rm", "-f", *files.paths])
        killed = False
        reason: str | None = "timeout" if timed_out else None
        if code != 0 or timed_out:
            oom, pids = await self._counters()
            if oom > self._oom_seen:
                killed, reason = True, "memory"
            elif pids > self._pids_seen:
                killed, reason = True, "pids"
            self._oom_seen, self._pids_seen = oom, pids
        if killed and reason == "memory" and not await self.is_alive():
            reason = "memory (the container was OOM-killed)"
        return ExecResult(
            exit_code=code,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=timed_out,
            killed=killed,
            reason=reason,
        )

    async def spawn(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> SandboxProcess:
        """Start ``cmd`` as an attached exec (stdin and stdout streamed over the daemon's
        hijacked connection) in a session of its own, which :meth:`SandboxProcess.kill` kills
        whole. :class:`SandboxError` when the exec cannot be created or attached."""
        if not cmd:
            raise ValueError("spawn needs a command")
        sid_file = shell.SessionFiles.new(_RUNNER_STATE_DIR).sid
        argv = shell.docker_spawn_argv(cmd, sid_file, _RUNNER_SETPRIV)

        def create() -> str:
            made = self._client.api.exec_create(
                self._container.id,
                argv,
                stdin=True,
                stdout=True,
                stderr=True,
                tty=False,
                environment=dict(env or {}),
                workdir=cwd or self._spec.workdir,
                user=RUNNER_USER,
            )
            return str(made["Id"])

        try:
            exec_id = await asyncio.to_thread(create)
            reader, writer = await _attach(self._client, exec_id)
        except Exception as e:
            raise SandboxError(f"docker sandbox {self.id}: cannot start {cmd[0]!r}: {e}") from e

        async def kill_session() -> None:
            # Root reads the root-only sid file but, without CAP_KILL, cannot signal other
            # uids: the runner's processes and then the model's are killed as their own uid.
            line = shell.kill_line(sid_file, sid_file, as_uids=(RUNNER_UID, UID))
            await self._kill_session(line, RUNNER_USER)

        return DockerProcess(reader, writer, kill_session)

    async def _kill_session(self, line: str, user: str) -> None:
        """Run the session kill ``line`` (:func:`~corral.sandboxes.shell.kill_line`) as
        ``user``. Never raises: a failure is logged (the container's end kills everything
        anyway)."""
        try:
            await self._raw(["sh", "-c", line], user=user)
        except SandboxError as e:
            log.debug("docker sandbox %s: session kill failed: %s", self.id, e)

    # -- files --------------------------------------------------------------------------------

    def _in_workdir(self, path: str) -> bool:
        p = PurePosixPath(os.path.normpath(path))
        return p.is_absolute() and (
            p == PurePosixPath(self._spec.workdir) or PurePosixPath(self._spec.workdir) in p.parents
        )

    def _abs(self, path: str) -> str:
        p = PurePosixPath(path)
        return str(p if p.is_absolute() else PurePosixPath(self._spec.workdir) / p)

    async def _write_via_exec(self, path: str, data: bytes) -> None:
        q = shlex.quote(path)
        code, _, err = await self._raw(["sh", "-c", f'mkdir -p "$(dirname {q})" && : > {q}'])
        if code != 0:
            raise SandboxError(f"cannot write {path}: {err.decode(errors='replace').strip()}")
        chunk = 64 * 1024  # well under the kernel's 128 KiB limit for one argument
        for i in range(0, len(data), chunk):
            b64 = base64.b64encode(data[i : i + chunk]).decode()
            code, _, err = await self._raw(
                ["sh", "-c", f'printf %s "$1" | base64 -d >> {q}', "sh", b64]
            )
            if code != 0:
                raise SandboxError(f"cannot write {path}: {err.decode(errors='replace').strip()}")

    async def write_file(self, path: str, data: bytes) -> None:
        path = self._abs(path)
        if not self._in_workdir(path):
            await self._write_via_exec(path, data)
            return
        parent = str(PurePosixPath(path).parent)
        code, _, err = await self._raw(["mkdir", "-p", parent])
        if code != 0:
            raise SandboxError(f"cannot create {parent}: {err.decode(errors='replace').strip()}")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(PurePosixPath(path).name)
            info.size = len(data)
            info.mode = 0o644
            info.uid = info.gid = UID  # owned by the sandbox's user, as if it wrote the file
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
        try:
            ok = await asyncio.to_thread(self._container.put_archive, parent, buf.getvalue())
        except Exception as e:
            raise SandboxError(f"docker sandbox {self.id}: cannot write {path}: {e}") from e
        if not ok:
            raise SandboxError(f"docker sandbox {self.id}: cannot write {path}")

    async def read_file(self, path: str) -> bytes:
        path = self._abs(path)
        if not self._in_workdir(path):
            code, out, err = await self._raw(["base64", "-w0", path])
            if code != 0:
                raise SandboxError(f"cannot read {path}: {err.decode(errors='replace').strip()}")
            return base64.b64decode(out)

        def get() -> bytes:
            stream, _ = self._container.get_archive(path)
            raw = b"".join(stream)
            with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
                member = tar.next()
                if member is None or not member.isfile():
                    raise SandboxError(f"{path} is not a regular file")
                f = tar.extractfile(member)
                assert f is not None
                return f.read()

        try:
            return await asyncio.to_thread(get)
        except SandboxError:
            raise
        except Exception as e:
            raise SandboxError(f"docker sandbox {self.id}: cannot read {path}: {e}") from e

    # -- the rest -----------------------------------------------------------------------------

    async def endpoint(self, port: int) -> Endpoint:
        """With host networking: ``127.0.0.1:port`` (the sandbox shares the host's network).
        With network ``none`` nothing inside is reachable from outside: use :meth:`exec`."""
        if self._host_net:
            return Endpoint("127.0.0.1", port)
        raise SandboxError(
            f"docker sandbox {self.id} has network 'none': no service inside is reachable; "
            "talk to it through exec (or use a provider with allow_host_network=True)"
        )

    async def is_alive(self) -> bool:
        """Whether the container runs. Never raises: a container the daemon no longer knows
        is not alive, nor is one whose state cannot be read (logged, with the error)."""
        import docker.errors

        try:
            await asyncio.to_thread(self._container.reload)
        except docker.errors.NotFound as e:
            log.debug("docker sandbox %s is gone: %s", self.id, e)
            return False
        except Exception as e:
            log.warning("docker sandbox %s: cannot read its state: %s", self.id, e)
            return False
        return bool(self._container.status == "running")

    async def _close(self) -> None:
        await asyncio.to_thread(_remove, self._client, self.id)


async def _attach(client: Any, exec_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Start exec ``exec_id`` attached: the daemon answers ``101 UPGRADED`` and the connection
    then carries stdin one way and multiplexed stdout/stderr frames the other. The handshake is
    done here, on an asyncio stream, so that no byte after the headers is lost to an HTTP
    library's read buffer (which would break the frame stream)."""
    adapter = getattr(client.api, "_custom_adapter", None)
    socket_path = getattr(adapter, "socket_path", None)
    if socket_path:
        reader, writer = await asyncio.open_unix_connection(socket_path, limit=MAX_LINE)
    else:
        url = str(client.api.base_url)
        if not url.startswith("http://"):
            raise SandboxError(f"attached exec needs a unix:// or plain tcp:// daemon, not {url}")
        host, _, port = url.removeprefix("http://").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port or 2375), limit=MAX_LINE)
    body = b'{"Detach": false, "Tty": false}'
    head = (
        f"POST /exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\n"
        "Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    headers = await reader.readuntil(b"\r\n\r\n")
    status = headers.split(b"\r\n", 1)[0].decode(errors="replace")
    if " 101 " not in status and " 200 " not in status:
        writer.close()
        raise SandboxError(f"the daemon refused the attach: {status}")
    return reader, writer


class DockerProcess(SandboxProcess):
    """An attached docker exec: stdin goes down the hijacked connection; a pump splits the
    daemon's frames (8-byte header: stream, 3 zero bytes, big-endian length) into stdout lines
    and the stderr tail."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        kill_session: Callable[[], Awaitable[None]],
    ) -> None:
        self._writer = writer
        self._kill_session = kill_session
        self._out = LineBuffer()
        self._pump = asyncio.ensure_future(self._read_frames(reader))

    async def _read_frames(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header = await reader.readexactly(8)
                size = int.from_bytes(header[4:], "big")
                payload = await reader.readexactly(size)
                if header[0] == 2:
                    self._out.add_stderr(payload)
                else:
                    self._out.feed(payload)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._out.close()

    async def write(self, data: bytes) -> None:
        if self.killing or self._writer.is_closing() or self._out.closed:
            raise SandboxError("the process has exited")
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            raise SandboxError(f"the process has exited: {e}") from e

    async def readline(self) -> bytes:
        return await self._out.readline()

    async def _kill(self) -> None:
        """Kill the exec's whole session, then close the connection."""
        await self._kill_session()  # never raises
        self._writer.close()
        # The pump ends once the daemon closes its side; it is not waited for forever.
        _, late = await asyncio.wait({self._pump}, timeout=2.0)
        for pump in late:
            pump.cancel()

    def stderr_tail(self) -> str:
        return self._out.stderr_tail()


def _remove(client: Any, name: str) -> None:
    """Remove the container and its working-folder volume; absent ones are fine."""
    import docker.errors

    try:
        client.api.remove_container(name, force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if "is already in progress" not in str(e):
            raise
    for _ in range(50):
        try:
            client.api.remove_volume(name, force=True)
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as e:  # still in use while the removal finishes
            if "in use" not in str(e):
                raise
            time.sleep(0.1)


_SAFE = re.compile(r"[^a-zA-Z0-9_.-]")


class DockerProvider(SandboxProvider):
    """Docker sandboxes labelled with ``owner``. ``client``: a ``docker.DockerClient`` (default:
    from the environment, ``DOCKER_HOST``). ``allow_host_network``: map policy ``loopback`` to
    host networking (exposes all host ports; see the module docstring)."""

    name = "docker"

    def __init__(
        self,
        owner: str,
        *,
        client: Any = None,
        image: str = DEFAULT_TAG,
        allow_host_network: bool = False,
    ):
        self.owner = owner
        self._client = client
        self.image = image
        self.allow_host_network = allow_host_network

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = _client()
        return self._client

    def model_jail(self, spec: SandboxSpec) -> tuple[str, ...]:
        """``setpriv`` from the runner (:data:`RUNNER_UID` with :data:`RUNNER_CAPS`) to :data:`UID`
        (module docstring). The bounding set stays (dropping it needs ``CAP_SETPCAP``, which
        the runner does not hold); ``no-new-privileges`` keeps anything in it out of reach."""
        return setpriv_jail(UID, setpcap=False)

    def _labels(self, name: str, spec: SandboxSpec) -> dict[str, str]:
        return {
            **spec.labels,
            OWNER_LABEL: self.owner,
            SANDBOX_LABEL: name,
            **owner_labels(spec.ttl_s),
        }

    async def create(self, spec: SandboxSpec) -> Sandbox:
        if spec.rootfs is not None:
            raise SandboxError("the docker backend runs images; spec.rootfs is for bwrap")
        mode = spec.network.mode
        if mode == "allowlist":
            raise SandboxError("the docker backend cannot enforce an allowlist network policy")
        if mode == "loopback" and not self.allow_host_network:
            raise SandboxError(
                "the docker backend cannot limit a sandbox to the env server's port; "
                "make the provider with allow_host_network=True to share the host's network"
            )
        host_net = mode == "loopback"
        name = f"corral-{_SAFE.sub('_', self.owner)[:40]}-{uuid.uuid4().hex[:12]}"
        labels = self._labels(name, spec)
        try:
            container = await asyncio.to_thread(self._create, name, spec, labels, host_net)
        except BaseException as e:
            # Whatever was made is labelled; remove it now (a crash here leaves it to sweep).
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.to_thread(_remove, self.client, name))
            if isinstance(e, Exception):
                raise SandboxError(f"docker sandbox could not be created: {e}") from e
            raise
        return DockerSandbox(self.client, container, name, spec, host_net=host_net)

    def _create(self, name: str, spec: SandboxSpec, labels: dict[str, str], host_net: bool) -> Any:
        from docker.types import Mount

        client = self.client
        disk = spec.disk_mb or DEFAULT_DISK_MB
        client.volumes.create(
            name=name,
            driver="local",
            driver_opts={"type": "tmpfs", "device": "tmpfs", "o": f"size={disk}m,mode=1777"},
            labels=labels,
        )
        mounts = [Mount(target=spec.workdir, source=name, type="volume")]
        for b in spec.binds:
            mounts.append(
                Mount(target=b.target, source=str(b.source), type="bind", read_only=not b.writable)
            )
        memory = f"{spec.memory_mb or DEFAULT_MEMORY_MB}m"
        keeper = ["sleep", str(int(spec.ttl_s) + 1) if spec.ttl_s is not None else "infinity"]
        container = client.containers.create(
            self.image,
            command=keeper,
            name=name,
            hostname="sandbox",
            # Root, so that the runner's exec gets RUNNER_CAPS: docker empties the permitted
            # and effective sets of every exec of a container whose configured user is not
            # root, whatever user the exec asks for. Every other exec names EXEC_USER.
            user=RUNNER_USER,
            labels=labels,
            environment=dict(spec.env),
            working_dir=spec.workdir,
            network_mode="host" if host_net else "none",
            mem_limit=memory,
            memswap_limit=memory,
            nano_cpus=int((spec.cpus or DEFAULT_CPUS) * 1e9),
            pids_limit=spec.pids or DEFAULT_PIDS,
            read_only=True,
            tmpfs={"/tmp": f"rw,nosuid,nodev,exec,size={TMP_MB}m,mode=1777"},
            mounts=mounts,
            cap_drop=["ALL"],
            cap_add=list(RUNNER_CAPS),
            security_opt=["no-new-privileges"],
            init=True,
            auto_remove=False,
            detach=True,
        )
        container.start()
        return container

    async def list_owned(self) -> list[str]:
        def run() -> list[str]:
            found = self.client.containers.list(
                all=True, filters={"label": f"{OWNER_LABEL}={self.owner}"}
            )
            return sorted(c.name for c in found)

        return await asyncio.to_thread(run)

    async def sweep(self) -> list[str]:
        """Remove corral containers (and their volumes) whose owner process is gone (same host:
        pid + start time + boot id), that outlived their ``corral.expires`` label, or that
        stopped; any owner's, not only this provider's."""

        def run() -> list[str]:
            now = time.time()
            client = self.client
            gone: set[str] = set()
            for c in client.containers.list(all=True, filters={"label": OWNER_LABEL}):
                labels = c.labels or {}
                if owner_gone(labels) or expired(labels, now) or c.status in ("exited", "dead"):
                    _remove(client, c.name)
                    gone.add(c.name)
            for v in client.volumes.list(filters={"label": OWNER_LABEL}):
                labels = v.attrs.get("Labels") or {}
                if v.name not in gone and (owner_gone(labels) or expired(labels, now)):
                    with contextlib.suppress(Exception):
                        _remove(client, v.name)
                        gone.add(v.name)
            return sorted(gone)

        return await asyncio.to_thread(run)
