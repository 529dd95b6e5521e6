"""The ``kubernetes`` backend: one Pod (plus one NetworkPolicy) per sandbox, through the API.

What each sandbox gets (:meth:`KubernetesProvider.create`; the manifests are built in
:mod:`corral.sandboxes.k8s_manifests`):

- a Pod named before the create call, labelled ``corral.owner``, ``corral.sandbox`` (its name),
  the owner's host, boot id, pid and process start time, the expiry time, and ``spec.labels``:
  the labels are part of the create call, so a server that crashes between "create requested"
  and "create answered" leaves a labelled Pod that :meth:`KubernetesProvider.sweep` removes;
- ``automountServiceAccountToken: false`` and ``enableServiceLinks: false`` (no API credentials,
  no service addresses in the environment); ``restartPolicy: Never``; ``shareProcessNamespace``
  so that the pause container is PID 1 and reaps orphans (the keeper does not);
- ``activeDeadlineSeconds`` = ``ttl_s``: the kubelet fails the Pod once its time to live is over,
  even when no sweep runs; the keeper (the container's command) is ``sleep <ttl_s + 1>``;
- limits, requested as much as limited (the scheduler reserves them; Guaranteed QoS): ``cpus``
  (default 1.0), ``memory_mb`` (default 1024), ``ephemeral-storage`` of ``disk_mb`` (default 256)
  plus 64 MiB for ``/tmp``; the working folder and ``/tmp`` are ``emptyDir`` volumes with those
  size limits (the kubelet evicts a Pod that overruns them);
- runs as uid/gid 1000 (``runAsNonRoot``), ``allowPrivilegeEscalation: false``, every capability
  dropped, a read-only root filesystem, the runtime's default seccomp profile;
- a NetworkPolicy of the same name selecting only this Pod, with both policy types: policy
  ``none`` allows nothing in or out; ``loopback`` allows egress to the env server's address
  (``env_server_cidr``, on ``server_port`` when one is known), DNS to the cluster DNS
  namespace, and ingress from the env server (so :meth:`KubernetesSandbox.endpoint` works);
  ``allowlist`` allows egress to the listed IP addresses/CIDRs only (NetworkPolicy matches IPs,
  so hostnames are refused). The policy has an ownerReference to its Pod (the garbage collector
  removes it with the Pod) and is also deleted explicitly at close and sweep. The Pod is
  created first (the ownerReference needs its uid): until the policy exists, only the keeper
  runs in it, and :meth:`~KubernetesProvider.create` returns after both exist.

Readiness: ``create`` polls the Pod until it runs and its container is ready, for at most
``start_timeout`` seconds. A container stuck in ``ImagePullBackOff`` (or another state that
does not heal by waiting), a failed Pod, or the timeout (its message names what the Pod waited
for, e.g. ``Unschedulable: 0/3 nodes are available``) deletes everything and raises.

Exec goes through the API's exec stream (:mod:`corral.sandboxes.k8s_exec`: a WebSocket,
``v5.channel.k8s.io`` or ``v4.channel.k8s.io``) on a thread of its own per call: a few
long-running streams never starve the default executor that short API calls use. Commands
follow :mod:`corral.sandboxes.shell`: each runs as ``setsid -w sh -c WRAPPER`` so that it leads
a session of its own, whose id the wrapper writes to ``/tmp/.corral/<tag>.sid``. Two timeouts,
as in the docker backend: inside, ``timeout --kill-after=1`` signals the command's process
group; then (or when the exec has not returned ``timeout + 4`` s later) a second exec kills
every process of the session (``pkill -KILL -s``), which also ends children that moved to a
process group of their own. Closing an exec stream does not stop the process on a real
cluster, so cancelled execs and killed spawned processes get the same session kill, and a
spawned process that ends by itself takes what it left in its session with it. stdin is
framed by length (``head -c N``), so it works on servers that cannot close a stream's stdin
(``v4``). Files move as raw bytes over the stream (``cat``). An exec whose command was
OOM-killed is ``killed`` with reason ``memory ...``, from the container's ``OOMKilled`` status
(cgroup-v2 nodes kill the whole container) or the memory cgroup's counter.

The image needs ``sh``, coreutils (``timeout``, ``head``, ``cat``, ``env``), ``setsid``
(util-linux) and ``pkill`` (procps): :mod:`corral.sandboxes.image`'s image has them.

Not enforced by the Pod spec: a pids limit (only the kubelet's node-wide ``podPidsLimit``
applies; ``spec.pids`` is ignored, with a warning); the NetworkPolicy on a cluster whose network
plugin does not enforce NetworkPolicy (flannel alone, kind before v0.24: the policy is stored and
silently ignored; see docs/kubernetes.md). ``timeout`` does not bound what a command started
with ``setsid`` (it leaves the session): that dies with the Pod, at ``close`` or the deadline.

Model actions (:meth:`SandboxProvider.model_jail`): empty. The Pod follows the "restricted"
Pod Security standard (``runAsNonRoot``, every capability dropped, no privilege escalation,
the runtime's seccomp profile, which refuses user namespaces), so there is no second uid to
switch to and no nested namespace to make: the runner and the model share uid 1000. What holds
is the runner's own hardening (:mod:`corral.envs.runner`: non-dumpable, private protocol
descriptors); the model can still signal the runner and change its uploaded code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from corral.sandboxes import shell
from corral.sandboxes.base import (
    OWNER_LABEL,
    Endpoint,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxProcess,
    SandboxProvider,
    SandboxSpec,
)
from corral.sandboxes.cgroups import event_count
from corral.sandboxes.image import DEFAULT_TAG
from corral.sandboxes.k8s_exec import (
    ExecStream,
    KubernetesProcess,
    api_error,
    close_stream,
    exit_code,
    in_thread,
    open_stream,
    pump,
    send_all,
)
from corral.sandboxes.k8s_manifests import (
    CONTAINER,
    PolicyRules,
    label_value,
    live,
    name_labels,
    name_part,
    oom_killed,
    pod_manifest,
    policy_manifest,
    policy_rules,
    readiness,
    sandbox_labels,
)
from corral.sandboxes.ownership import expired, owner_gone

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_START_TIMEOUT_S = 120.0
API_TIMEOUT_S = 30.0  # one API request; a hung connection must not hang a sandbox operation
KILL_TIMEOUT_S = 10.0  # for the session-kill exec itself
SPAWN_START_TIMEOUT_S = 30.0
FILE_TIMEOUT_S = 120.0
_OOM_CONTAINER = "memory: the container was OOM-killed (the sandbox is gone)"


class PodApi:
    """The API calls of one provider and its sandboxes, in ``namespace``: plain calls on the
    provider's ApiClient, exec streams on a second one (``kubernetes.stream`` swaps its
    ApiClient's ``call_api`` while it connects, so streams get an ApiClient of their own, and
    connect one at a time, leaving concurrent plain calls unaffected)."""

    def __init__(self, client: k8s.ApiClient, namespace: str) -> None:
        self.namespace = namespace
        self.core = k8s.CoreV1Api(client)
        self.net = k8s.NetworkingV1Api(client)
        self._stream_core = k8s.CoreV1Api(k8s.ApiClient(client.configuration))
        self._stream_lock = threading.Lock()

    async def call(self, what: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(*args, **kw)`` on a worker thread with a request timeout; :class:`SandboxError`
        naming ``what`` when the API refuses or cannot be reached."""
        try:
            return await asyncio.to_thread(fn, *args, _request_timeout=API_TIMEOUT_S, **kw)
        except ApiException as e:
            raise SandboxError(f"kubernetes: {what} failed: {api_error(e)}") from e
        except Exception as e:  # connection refused, timeouts, bad answers
            raise SandboxError(f"kubernetes: {what} failed: {e}") from e

    def connect(self, pod: str, argv: Sequence[str], *, stdin: bool) -> ExecStream:
        """(worker thread) Open an exec stream running ``argv`` in Pod ``pod``'s sandbox
        container. :class:`SandboxError` when the API refuses."""
        return open_stream(
            self._stream_core,
            self._stream_lock,
            pod,
            self.namespace,
            CONTAINER,
            argv,
            stdin=stdin,
        )

    async def read_pod(self, name: str) -> k8s.V1Pod | None:
        """The Pod, or ``None`` when it does not exist. :class:`SandboxError` on API errors."""
        try:
            return await asyncio.to_thread(
                self.core.read_namespaced_pod,
                name,
                self.namespace,
                _request_timeout=API_TIMEOUT_S,
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise SandboxError(f"kubernetes: reading pod {name} failed: {api_error(e)}") from e
        except Exception as e:
            raise SandboxError(f"kubernetes: reading pod {name} failed: {e}") from e

    async def delete(self, name: str) -> None:
        """Delete Pod ``name`` (grace period 0) and its NetworkPolicy; absent ones are fine.
        Both are attempted; then :class:`SandboxError` naming what failed, if anything did."""
        now = k8s.V1DeleteOptions(grace_period_seconds=0, propagation_policy="Background")
        calls: list[tuple[str, Callable[..., Any]]] = [
            (f"deleting pod {name}", self.core.delete_namespaced_pod),
            (f"deleting network policy {name}", self.net.delete_namespaced_network_policy),
        ]
        errors = []
        for what, fn in calls:
            try:
                await asyncio.to_thread(
                    fn,
                    name,
                    self.namespace,
                    body=now,
                    grace_period_seconds=0,
                    _request_timeout=API_TIMEOUT_S,
                )
            except ApiException as e:
                if e.status != 404:
                    errors.append(f"{what} failed: {api_error(e)}")
            except Exception as e:
                errors.append(f"{what} failed: {e}")
        if errors:
            raise SandboxError(f"kubernetes: {'; '.join(errors)}")


@dataclass(frozen=True, slots=True)
class _Outcome:
    """A wrapped command's end. ``lost``: why there is no exit status (the stream ended early,
    or the API reported a failure without one); ``None`` when there is one."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    lost: str | None


class KubernetesSandbox(Sandbox):
    """One Pod. Everything goes through ``api`` (its provider's); see the module docstring."""

    def __init__(self, api: PodApi, name: str, spec: SandboxSpec, pod_ip: str | None):
        self.id = name
        self._api = api
        self._spec = spec
        self._pod_ip = pod_ip
        self._oom_seen = 0
        self._processes: set[KubernetesProcess] = set()

    # -- streams ------------------------------------------------------------------------------

    async def _open(self, argv: list[str], *, stdin: bool) -> ExecStream:
        """Connect an exec stream for ``argv``. :class:`SandboxError` once closed, when the
        API refuses (Pod gone, not running) or does not answer within ``API_TIMEOUT_S``. A
        stream that connects after the caller gave up is closed at once."""
        if self._closing is not None:
            raise SandboxError(f"kubernetes sandbox {self.id} is closed")
        fut = asyncio.ensure_future(
            asyncio.to_thread(self._api.connect, self.id, argv, stdin=stdin)
        )
        try:
            return await asyncio.wait_for(asyncio.shield(fut), API_TIMEOUT_S)
        except TimeoutError:
            fut.add_done_callback(close_stream)
            raise SandboxError(
                f"kubernetes sandbox {self.id}: the exec stream did not connect within "
                f"{API_TIMEOUT_S:g} s"
            ) from None
        except asyncio.CancelledError:
            fut.add_done_callback(close_stream)
            raise

    async def _raw(self, argv: list[str], timeout: float) -> tuple[int, bytes, bytes]:  # noqa: ASYNC109
        """Run ``argv`` as is (no wrapper, no stdin); ``timeout`` bounds the wait, not the
        command. :class:`SandboxError` when it cannot be run or does not answer in time."""
        stream = await self._open(argv, stdin=False)
        out, err = bytearray(), bytearray()
        frames = pump(stream, out.extend, err.extend)
        try:
            status = await asyncio.wait_for(asyncio.shield(frames), timeout)
        except TimeoutError:
            stream.abort()
            raise SandboxError(f"kubernetes sandbox {self.id}: {argv[0]} did not answer") from None
        except BaseException:
            stream.abort()
            raise
        if status is None:
            raise SandboxError(f"kubernetes sandbox {self.id}: exec ended without a status")
        return exit_code(status), bytes(out), bytes(err)

    async def _kill_session(self, files: shell.SessionFiles) -> None:
        """SIGKILL what runs in the session named in ``files.sid`` and remove the file. Never
        raises: a failure is logged (the Pod's end kills everything anyway)."""
        try:
            await self._raw(["sh", "-c", shell.kill_line(files.sid, files.sid)], KILL_TIMEOUT_S)
        except Exception as e:
            log.debug("kubernetes sandbox %s: session kill %s failed: %s", self.id, files.sid, e)

    # -- exec ---------------------------------------------------------------------------------

    async def exec(
        self,
        cmd: Sequence[str],
        *,
        timeout: float,  # noqa: ASYNC109 -- the deadline that kills the process tree inside
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` in the Pod (see the module docstring for the two timeouts). ``killed``
        with ``reason`` ``memory ...`` when the container or the command was OOM-killed.
        :class:`SandboxError` when the Pod is gone or the stream fails."""
        run = await self._run(cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin)
        reason: str | None = "timeout" if run.timed_out else None
        killed = False
        if run.lost:
            # No exit status: the container (or the Pod) went away under the command.
            pod = await self._api.read_pod(self.id)
            if pod is None or not oom_killed(pod):
                state = "deleted" if pod is None else readiness(pod)[1] or "running"
                raise SandboxError(f"kubernetes sandbox {self.id}: {run.lost}; pod {state}")
            killed, reason = True, _OOM_CONTAINER
        elif run.exit_code == 137 and not run.timed_out:
            oom = await self._oom_reason()
            killed, reason = oom is not None, oom
        return ExecResult(
            exit_code=run.exit_code,
            stdout=run.stdout.decode(errors="replace"),
            stderr=run.stderr.decode(errors="replace"),
            timed_out=run.timed_out,
            killed=killed,
            reason=reason,
        )

    async def _run(
        self,
        cmd: Sequence[str],
        *,
        timeout: float,  # noqa: ASYNC109
        env: Mapping[str, str] | None,
        cwd: str | None,
        stdin: bytes | None,
    ) -> _Outcome:
        """Run ``cmd`` wrapped (:func:`~corral.sandboxes.shell.k8s_exec_argv`) and enforce
        both timeouts; the raw outcome. :class:`SandboxError` when the stream cannot be
        opened. A cancelled caller gets the command's session killed first (closing the
        stream does not stop it on a real cluster)."""
        t = shell.inner_timeout(timeout)
        files = shell.SessionFiles.new()
        argv = shell.k8s_exec_argv(
            cmd,
            files,
            env=env,
            cwd=cwd or self._spec.workdir,
            t=t,
            stdin_len=len(stdin) if stdin is not None else None,
        )
        started = time.monotonic()
        stream = await self._open(argv, stdin=stdin is not None)
        out, err = bytearray(), bytearray()
        frames = pump(stream, out.extend, err.extend)
        if stdin is not None:
            # From a thread of its own: a command that writes much before it reads its stdin
            # must not deadlock against a sender blocked on a full connection.
            in_thread(send_all, stream, stdin)

        async def kill() -> None:
            await self._kill_session(files)

        status, host_killed = await shell.wait_or_kill(
            frames,
            deadline=shell.host_deadline(t),
            kill=kill,
            kill_wait=KILL_TIMEOUT_S,
            drop=stream.abort,
            lost=None,
        )
        elapsed = time.monotonic() - started
        if status is None and not host_killed:
            lost = "the exec stream ended without an exit status"
            return _Outcome(137, bytes(out), bytes(err), timed_out=False, lost=lost)
        try:
            code = exit_code(status) if status is not None else 137
        except SandboxError as e:  # a failure without an exit code: the command never ran
            return _Outcome(137, bytes(out), bytes(err), timed_out=False, lost=str(e))
        timed_out = shell.timed_out(code, elapsed, t, host_killed=host_killed)
        if timed_out and not host_killed:
            # What left timeout's process group (setpgid) is still in the session: kill it.
            await kill()
        return _Outcome(code, bytes(out), bytes(err), timed_out=timed_out, lost=None)

    async def _oom_reason(self) -> str | None:
        """Why a command died of SIGKILL, when memory was the cause: the container's status
        (cgroup v2 nodes kill the whole container, ``memory.oom.group``), else the memory
        cgroup's OOM-kill counter as seen inside (only the command was killed)."""
        pod = await self._api.read_pod(self.id)
        if pod is not None and oom_killed(pod):
            return _OOM_CONTAINER
        if pod is None or not live(pod):
            return None
        script = (
            "cat /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control "
            "2>/dev/null; true"
        )
        try:
            _, text, _ = await self._raw(["sh", "-c", script], KILL_TIMEOUT_S)
        except SandboxError as e:
            log.debug("kubernetes sandbox %s: cannot read the OOM counter: %s", self.id, e)
            return None
        seen = event_count(text.decode(errors="replace"), "oom_kill")
        grew, self._oom_seen = seen > self._oom_seen, max(seen, self._oom_seen)
        return "memory: OOM-killed" if grew else None

    # -- spawn --------------------------------------------------------------------------------

    async def spawn(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> SandboxProcess:
        """Start ``cmd`` on an exec stream kept open (stdin, stdout, stderr) in a session of
        its own, and return once it was exec'd. :class:`SandboxError` when the stream cannot
        be opened or the command does not start (e.g. a missing ``cwd``: the message says)."""
        files = shell.SessionFiles.new()
        argv = shell.k8s_spawn_argv(cmd, files, env=env, cwd=cwd or self._spec.workdir)
        stream = await self._open(argv, stdin=True)
        proc = KubernetesProcess(
            stream, functools.partial(self._kill_session, files), self._processes.discard
        )
        self._processes.add(proc)
        try:
            await proc.wait_started(SPAWN_START_TIMEOUT_S)
        except BaseException as e:
            await asyncio.shield(proc.kill())
            if isinstance(e, SandboxError):
                raise SandboxError(
                    f"kubernetes sandbox {self.id}: cannot start {cmd[0]!r}: {e}"
                ) from None
            raise
        return proc

    # -- files --------------------------------------------------------------------------------

    def _abs(self, path: str) -> str:
        p = PurePosixPath(path)
        return str(p if p.is_absolute() else PurePosixPath(self._spec.workdir) / p)

    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` (relative: under the working folder), parents created.
        The bytes go as they are on the stream's stdin. :class:`SandboxError` on failure."""
        path = self._abs(path)
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        r = await self.exec(["sh", "-c", script, "sh", path], timeout=FILE_TIMEOUT_S, stdin=data)
        if r.exit_code != 0:
            raise SandboxError(
                f"kubernetes sandbox {self.id}: cannot write {path}: {r.stderr.strip()}"
            )

    async def read_file(self, path: str) -> bytes:
        """The bytes at ``path`` (relative: under the working folder). :class:`SandboxError` if
        it is missing or not a regular file."""
        path = self._abs(path)
        script = 'test -f "$1" || { echo "no such file: $1" >&2; exit 1; }; cat -- "$1"'
        run = await self._run(
            ["sh", "-c", script, "sh", path], timeout=FILE_TIMEOUT_S, env=None, cwd="/", stdin=None
        )
        if run.lost or run.exit_code != 0:
            why = run.lost or run.stderr.decode(errors="replace").strip()
            why = why or f"exit code {run.exit_code}"
            raise SandboxError(f"kubernetes sandbox {self.id}: cannot read {path}: {why}")
        return run.stdout

    # -- the rest -----------------------------------------------------------------------------

    async def endpoint(self, port: int) -> Endpoint:
        """The Pod's IP and ``port`` under policy ``loopback`` (its NetworkPolicy lets the env
        server's address in). Under ``none``/``allowlist`` the policy denies all ingress:
        :class:`SandboxError` (talk to the sandbox through exec)."""
        mode = self._spec.network.mode
        if mode != "loopback":
            raise SandboxError(
                f"kubernetes sandbox {self.id} has network policy {mode!r}: its NetworkPolicy "
                "denies all ingress, so no service inside is reachable; talk to it through "
                "exec, or use policy 'loopback' (ingress from the env server's address)"
            )
        if self._pod_ip is None:
            pod = await self._api.read_pod(self.id)
            self._pod_ip = pod.status.pod_ip if pod is not None and pod.status else None
        if self._pod_ip is None:
            raise SandboxError(f"kubernetes sandbox {self.id} has no pod IP")
        return Endpoint(self._pod_ip, port)

    async def is_alive(self) -> bool:
        """Whether the Pod exists and runs (not failed, finished or being deleted). Never
        raises: a Pod that cannot be read is "not alive" (logged, with the error)."""
        try:
            pod = await self._api.read_pod(self.id)
        except SandboxError as e:
            log.warning("kubernetes sandbox %s: cannot read its pod: %s", self.id, e)
            return False
        return (
            pod is not None
            and pod.status is not None
            and pod.status.phase == "Running"
            and live(pod)
        )

    async def _close(self) -> None:
        for proc in list(self._processes):
            proc.abort()  # their processes die with the Pod
        await self._api.delete(self.id)


def _default_api_client() -> k8s.ApiClient:
    """An ApiClient from the kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``), else from the
    in-cluster service account. :class:`SandboxError` when neither exists."""
    from kubernetes import config

    try:
        return config.new_client_from_config(persist_config=False)
    except (config.ConfigException, OSError) as kube_error:
        configuration = k8s.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException as e:
            raise SandboxError(
                f"no Kubernetes configuration: kubeconfig: {kube_error}; in-cluster: {e}"
            ) from e
        return k8s.ApiClient(configuration)


class KubernetesProvider(SandboxProvider):
    """Kubernetes sandboxes in ``namespace``, labelled with ``owner``.

    ``api_client``: a ``kubernetes.client.ApiClient`` (default: made on first use from the
    kubeconfig, else the in-cluster config; never at import or construction).
    ``env_server_cidr``: the env server's address as Pods see it (an IP or CIDR), needed by
    policy ``loopback``; ``server_port``: its port when the spec does not say.
    ``dns_namespace``: where the cluster DNS runs (``loopback`` may reach it on port 53).
    ``start_timeout``: how long ``create`` waits for a Pod to be ready."""

    name = "kubernetes"
    host_binds = False

    def __init__(
        self,
        owner: str,
        *,
        namespace: str = "default",
        image: str = DEFAULT_TAG,
        api_client: k8s.ApiClient | None = None,
        env_server_cidr: str | None = None,
        server_port: int | None = None,
        dns_namespace: str = "kube-system",
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        self.owner = owner
        self.namespace = namespace
        self.image = image
        self.env_server_cidr = (
            str(ipaddress.ip_network(env_server_cidr, strict=False)) if env_server_cidr else None
        )
        self.server_port = server_port
        self.dns_namespace = dns_namespace
        self.start_timeout = start_timeout
        self._owner_value = label_value(owner)
        self._api_client = api_client
        self._api: PodApi | None = None
        self._warned_pids = False

    # -- API plumbing -------------------------------------------------------------------------

    async def _apis(self) -> PodApi:
        """The API, made on first use (loading a kubeconfig reads files and may run an auth
        plugin: off the event loop). :class:`SandboxError` without a configuration."""
        if self._api is None:
            client = self._api_client
            if client is None:
                # (Two first calls at once may both load it; the later one wins, harmlessly.)
                client = await asyncio.to_thread(_default_api_client)
                self._api_client = client
            if self._api is None:
                self._api = PodApi(client, self.namespace)
        return self._api

    # -- create -------------------------------------------------------------------------------

    def _validate(self, spec: SandboxSpec) -> PolicyRules:
        """Refuse what this backend cannot do, before any API call (:class:`SandboxError`);
        return the rules of the spec's network policy."""
        if spec.binds:
            raise SandboxError(
                "the kubernetes backend cannot mount host paths (spec.binds): its Pods run on "
                "cluster nodes; upload files with write_file instead"
            )
        if spec.rootfs is not None:
            raise SandboxError("the kubernetes backend runs images; spec.rootfs is for bwrap")
        workdir = PurePosixPath(spec.workdir)
        if not workdir.is_absolute() or str(workdir) in ("/", "/tmp"):
            raise SandboxError(
                f"workdir {spec.workdir!r} must be an absolute path other than / and /tmp"
            )
        if spec.pids is not None and not self._warned_pids:
            self._warned_pids = True
            log.warning(
                "kubernetes sandboxes: spec.pids is not enforced per Pod (only the kubelet's "
                "node-wide podPidsLimit applies)"
            )
        return policy_rules(
            spec.network,
            server_cidr=self.env_server_cidr,
            server_port=self.server_port,
            dns_namespace=self.dns_namespace,
        )

    async def create(self, spec: SandboxSpec) -> KubernetesSandbox:
        """Create the Pod, then its NetworkPolicy, then wait until the Pod is ready.
        :class:`SandboxError` (after deleting whatever was made) for what this backend refuses
        (binds, rootfs, hostnames in an allowlist, ``loopback`` without ``env_server_cidr``), an
        API error, or a Pod that failed or was not ready within ``start_timeout`` (the message
        carries the Pod's reason, e.g. ``ImagePullBackOff`` or ``Unschedulable``)."""
        rules = self._validate(spec)
        api = await self._apis()
        name = f"corral-{name_part(self.owner)}-{uuid.uuid4().hex[:12]}"
        labels = sandbox_labels(self._owner_value, name, spec)
        pod = pod_manifest(name, labels, spec, spec.image or self.image)
        try:
            made = await api.call(
                f"creating pod {name}", api.core.create_namespaced_pod, self.namespace, pod
            )
            uid = made.metadata.uid if made.metadata else None
            if not uid:
                raise SandboxError(f"kubernetes: the created pod {name} has no uid")
            await api.call(
                f"creating network policy {name}",
                api.net.create_namespaced_network_policy,
                self.namespace,
                policy_manifest(name, labels, uid, rules),
            )
            ready = await self._wait_ready(name)
        except BaseException as e:
            # Everything made is labelled; delete it now (a crash here leaves it to sweep).
            with contextlib.suppress(Exception):
                await asyncio.shield(api.delete(name))
            if isinstance(e, SandboxError):
                raise
            if isinstance(e, Exception):
                raise SandboxError(f"kubernetes sandbox could not be created: {e}") from e
            raise
        pod_ip = ready.status.pod_ip if ready.status else None
        return KubernetesSandbox(api, name, spec, pod_ip)

    async def _wait_ready(self, name: str) -> k8s.V1Pod:
        """Poll Pod ``name`` until it is ready. :class:`SandboxError` with the Pod's reason when
        it failed, or with what it was waiting for when ``start_timeout`` passed."""
        api = await self._apis()
        deadline = time.monotonic() + self.start_timeout
        delay = 0.05
        while True:
            pod = await api.read_pod(name)
            if pod is None:
                raise SandboxError(f"kubernetes pod {name} disappeared while starting")
            state, why = readiness(pod)
            if state == "ready":
                return pod
            if state == "failed":
                raise SandboxError(f"kubernetes pod {name} failed to start: {why}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxError(
                    f"kubernetes pod {name} was not ready after {self.start_timeout:g} s: {why}"
                )
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 1.5, 1.0)

    # -- ownership ----------------------------------------------------------------------------

    async def list_owned(self) -> list[str]:
        """Names of this owner's live Pods (not failed, finished or being deleted)."""
        api = await self._apis()
        pods = await api.call(
            "listing pods",
            api.core.list_namespaced_pod,
            self.namespace,
            label_selector=f"{OWNER_LABEL}={self._owner_value}",
        )
        return sorted(name_labels(p)[0] for p in pods.items if live(p))

    async def sweep(self) -> list[str]:
        """Delete corral Pods (any owner's) whose owner process is gone (same host: pid + start
        time + boot id), that outlived their ``corral.expires`` label, or that ended (failed,
        e.g. past their deadline, or succeeded), with their NetworkPolicies; then orphan
        NetworkPolicies (no Pod of their name) of this owner or of a dead or expired one.
        Return the names removed. :class:`SandboxError` when the API cannot be listed."""
        api = await self._apis()
        selector = OWNER_LABEL  # the key exists: every corral object
        # Policies are listed before Pods: a Pod is created before its policy, so a listed
        # policy whose Pod is missing from the later Pod list is a true orphan, never a create
        # in progress.
        policies = await api.call(
            "listing network policies",
            api.net.list_namespaced_network_policy,
            self.namespace,
            label_selector=selector,
        )
        pods = await api.call(
            "listing pods", api.core.list_namespaced_pod, self.namespace, label_selector=selector
        )
        now = time.time()
        gone: set[str] = set()
        pod_names = set()
        for pod in pods.items:
            name, labels = name_labels(pod)
            pod_names.add(name)
            stale = owner_gone(labels) or expired(labels, now) or not live(pod)
            if stale and await self._sweep_one(name):
                gone.add(name)
        for policy in policies.items:
            name, labels = name_labels(policy)
            if name in pod_names:
                continue
            mine = labels.get(OWNER_LABEL) == self._owner_value
            orphan = mine or owner_gone(labels) or expired(labels, now)
            if orphan and await self._sweep_one(name):
                gone.add(name)
        return sorted(gone)

    async def _sweep_one(self, name: str) -> bool:
        """Delete ``name``'s Pod and policy; a failure is logged (the sweep goes on with the
        others, and the next sweep retries it)."""
        try:
            await (await self._apis()).delete(name)
        except SandboxError as e:
            log.warning("kubernetes sweep: %s", e)
            return False
        return True
