"""The ``kubernetes`` backend: one Pod (plus one NetworkPolicy) per sandbox, through the API.

What each sandbox gets (:meth:`KubernetesProvider.create`):

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

Exec goes through the API's exec stream (a WebSocket, ``v5.channel.k8s.io`` or
``v4.channel.k8s.io``) on a thread of its own per call: a few long-running streams never
starve the default executor that short API calls use. Every command runs as
``setsid -w sh -c WRAPPER`` so that it leads a session of its own, whose id the wrapper writes
to ``/tmp/.corral/<tag>.sid``. Two timeouts, as in the docker backend: inside, ``timeout
--kill-after=1`` signals the command's process group; then (or when the exec has not returned
``timeout + 4`` s later) a second exec kills every process of the session (``pkill -KILL -s``),
which also ends children that moved to a process group of their own. Closing an exec stream does
not stop the process on a real cluster, so cancelled execs and killed spawned processes get the
same session kill, and a spawned process that ends by itself takes what it left in its session
with it. stdin is framed by length (``head -c N``), so it works on servers that cannot close a
stream's stdin (``v4``). Files move as raw bytes over the stream (``cat``). An exec whose
command was OOM-killed is ``killed`` with reason ``memory ...``, from the container's
``OOMKilled`` status (cgroup-v2 nodes kill the whole container) or the memory cgroup's counter.

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
import ipaddress
import json
import logging
import math
import re
import shlex
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from hashlib import sha256
from pathlib import PurePosixPath
from typing import Any, Literal, TypeVar

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import stream as k8s_stream
from websocket import ABNF, WebSocketException

from corral.sandboxes.base import (
    OWNER_LABEL,
    SANDBOX_LABEL,
    Endpoint,
    ExecResult,
    NetworkPolicy,
    Sandbox,
    SandboxError,
    SandboxProcess,
    SandboxProvider,
    SandboxSpec,
)
from corral.sandboxes.cgroups import event_count
from corral.sandboxes.image import DEFAULT_TAG
from corral.sandboxes.ownership import expired, owner_gone, owner_labels
from corral.sandboxes.streams import LineBuffer

log = logging.getLogger(__name__)

T = TypeVar("T")

CONTAINER = "sandbox"
UID = 1000
DEFAULT_MEMORY_MB = 1024
DEFAULT_CPUS = 1.0
DEFAULT_DISK_MB = 256
TMP_MB = 64
DEFAULT_START_TIMEOUT_S = 120.0
API_TIMEOUT_S = 30.0  # one API request; a hung connection must not hang a sandbox operation
HOST_GRACE_S = 3.0  # session kill this long after the in-sandbox timeout should have fired
KILL_TIMEOUT_S = 10.0  # for the session-kill exec itself
SPAWN_START_TIMEOUT_S = 30.0
FILE_TIMEOUT_S = 120.0
STDIN_CHUNK = 256 * 1024  # stdin frames; a frame is held whole in memory at both ends
_STATE_DIR = "/tmp/.corral"  # exec bookkeeping inside the sandbox (session ids)
_STARTED = b"corral-spawn-started"  # what a spawn's wrapper writes to stderr before exec
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Channel protocol of the exec stream (k8s.io/apimachinery/pkg/util/remotecommand).
STDIN, STDOUT, STDERR, ERROR, CLOSE = 0, 1, 2, 3, 255
V5 = "v5.channel.k8s.io"
# Container states that waiting does not heal: fail the create at once rather than time out.
# (ErrImagePull is retried by the kubelet and becomes ImagePullBackOff when it persists.)
_FATAL_WAITING = frozenset(
    {
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


# -- labels and names --------------------------------------------------------------------------


def label_value(text: str) -> str:
    """``text`` as a valid label value (at most 63 characters of ``[A-Za-z0-9_.-]``, alphanumeric
    at both ends). Valid text is kept as is; other text is mapped and suffixed with a hash of the
    original, so that different texts stay different."""
    if len(text) <= 63 and _LABEL_VALUE.match(text):
        return text
    digest = sha256(text.encode()).hexdigest()[:10]
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:52].strip("_.-")
    return f"{cleaned}-{digest}" if cleaned else digest


def _check_label_key(key: str) -> None:
    """:class:`SandboxError` unless ``key`` is a valid label key (``[prefix/]name``)."""
    prefix, _, name = key.rpartition("/")
    ok = len(name) <= 63 and _LABEL_NAME.match(name) is not None
    if prefix:
        ok = ok and len(prefix) <= 253 and all(_DNS_LABEL.match(p) for p in prefix.split("."))
    if not ok:
        raise SandboxError(f"{key!r} is not a valid Kubernetes label key")


def _name_part(owner: str) -> str:
    """A DNS-label-safe slug of ``owner`` for Pod names (readability only: not unique)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", owner.lower()).strip("-")[:30].strip("-")
    return slug or "sandbox"


# -- manifests ---------------------------------------------------------------------------------


def pod_manifest(name: str, labels: Mapping[str, str], spec: SandboxSpec, image: str) -> k8s.V1Pod:
    """The Pod for one sandbox (see the module docstring for every choice made here)."""
    memory = spec.memory_mb or DEFAULT_MEMORY_MB
    disk = spec.disk_mb or DEFAULT_DISK_MB
    cpus = spec.cpus or DEFAULT_CPUS
    limits = {
        "cpu": f"{max(1, round(cpus * 1000))}m",
        "memory": f"{memory}Mi",
        "ephemeral-storage": f"{disk + TMP_MB}Mi",
    }
    env = {"PATH": _PATH, "HOME": spec.workdir, "LANG": "C.UTF-8"} | dict(spec.env)
    ttl = math.ceil(spec.ttl_s) if spec.ttl_s is not None else None
    # The keeper outlives the deadline by a second: the Pod ends as Failed/DeadlineExceeded, a
    # reason that says what happened, rather than as Succeeded.
    keeper = ["sleep", str(ttl + 1) if ttl is not None else "infinity"]
    seccomp = k8s.V1SeccompProfile(type="RuntimeDefault")
    container = k8s.V1Container(
        name=CONTAINER,
        image=image,
        image_pull_policy="IfNotPresent",
        command=keeper,
        working_dir=spec.workdir,
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()],
        resources=k8s.V1ResourceRequirements(limits=limits, requests=dict(limits)),
        security_context=k8s.V1SecurityContext(
            run_as_non_root=True,
            run_as_user=UID,
            run_as_group=UID,
            privileged=False,
            allow_privilege_escalation=False,
            capabilities=k8s.V1Capabilities(drop=["ALL"]),
            read_only_root_filesystem=True,
            seccomp_profile=seccomp,
        ),
        volume_mounts=[
            k8s.V1VolumeMount(name="work", mount_path=spec.workdir),
            k8s.V1VolumeMount(name="tmp", mount_path="/tmp"),
        ],
    )
    pod_spec = k8s.V1PodSpec(
        containers=[container],
        restart_policy="Never",
        automount_service_account_token=False,
        enable_service_links=False,
        # The pause container becomes PID 1 of the Pod and reaps orphaned processes (the
        # keeper, ``sleep``, would leave them as zombies until the Pod ends).
        share_process_namespace=True,
        active_deadline_seconds=max(1, ttl) if ttl is not None else None,
        termination_grace_period_seconds=0,  # nothing inside needs a graceful stop
        security_context=k8s.V1PodSecurityContext(
            run_as_non_root=True, run_as_user=UID, run_as_group=UID, seccomp_profile=seccomp
        ),
        volumes=[
            k8s.V1Volume(name="work", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=f"{disk}Mi")),
            k8s.V1Volume(
                name="tmp", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=f"{TMP_MB}Mi")
            ),
        ],
    )
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(name=name, labels=dict(labels)),
        spec=pod_spec,
    )


def _ip_block(entry: str) -> k8s.V1NetworkPolicyPeer:
    try:
        net = ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        raise SandboxError(
            f"allowlist entry {entry!r} is not an IP address or CIDR: a Kubernetes "
            "NetworkPolicy matches addresses, not hostnames (resolve it yourself and list "
            "its addresses, knowing they may change)"
        ) from None
    return k8s.V1NetworkPolicyPeer(ip_block=k8s.V1IPBlock(cidr=str(net)))


@dataclass(frozen=True, slots=True)
class PolicyRules:
    """The ingress and egress rules of a sandbox's NetworkPolicy (empty: deny all)."""

    ingress: list[k8s.V1NetworkPolicyIngressRule]
    egress: list[k8s.V1NetworkPolicyEgressRule]


def policy_rules(
    policy: NetworkPolicy,
    *,
    server_cidr: str | None,
    server_port: int | None,
    dns_namespace: str,
) -> PolicyRules:
    """The rules for ``policy``. ``loopback`` needs ``server_cidr`` (the env server's address as
    the Pods see it); its port is ``policy.server_port``, else ``server_port``, else every port
    of that address. :class:`SandboxError` for a ``loopback`` without an address or an
    ``allowlist`` holding anything but IP addresses and CIDRs."""
    if policy.mode == "none":
        return PolicyRules([], [])
    if policy.mode == "allowlist":
        if not policy.allow:
            raise SandboxError("an allowlist network policy needs at least one address")
        return PolicyRules(
            [], [k8s.V1NetworkPolicyEgressRule(to=[_ip_block(a) for a in policy.allow])]
        )
    if server_cidr is None:
        raise SandboxError(
            "network policy 'loopback' on kubernetes needs the env server's address: make the "
            "provider with env_server_cidr= (the server's pod IP or its network, as Pods see it)"
        )
    server = k8s.V1NetworkPolicyPeer(ip_block=k8s.V1IPBlock(cidr=server_cidr))
    port = policy.server_port or server_port
    ports = [k8s.V1NetworkPolicyPort(protocol="TCP", port=port)] if port else None
    dns = k8s.V1NetworkPolicyPeer(
        namespace_selector=k8s.V1LabelSelector(
            match_labels={"kubernetes.io/metadata.name": dns_namespace}
        )
    )
    dns_ports = [k8s.V1NetworkPolicyPort(protocol=p, port=53) for p in ("UDP", "TCP")]
    return PolicyRules(
        ingress=[k8s.V1NetworkPolicyIngressRule(_from=[server])],
        egress=[
            k8s.V1NetworkPolicyEgressRule(to=[server], ports=ports),
            k8s.V1NetworkPolicyEgressRule(to=[dns], ports=dns_ports),
        ],
    )


def policy_manifest(
    name: str, labels: Mapping[str, str], pod_uid: str, rules: PolicyRules
) -> k8s.V1NetworkPolicy:
    """The NetworkPolicy that selects only Pod ``name`` (by its ``corral.sandbox`` label) and is
    owned by it (``pod_uid``): the garbage collector deletes it with the Pod."""
    owner = k8s.V1OwnerReference(
        api_version="v1", kind="Pod", name=name, uid=pod_uid, controller=False
    )
    return k8s.V1NetworkPolicy(
        api_version="networking.k8s.io/v1",
        kind="NetworkPolicy",
        metadata=k8s.V1ObjectMeta(name=name, labels=dict(labels), owner_references=[owner]),
        spec=k8s.V1NetworkPolicySpec(
            pod_selector=k8s.V1LabelSelector(match_labels={SANDBOX_LABEL: name}),
            policy_types=["Ingress", "Egress"],
            ingress=rules.ingress,
            egress=rules.egress,
        ),
    )


# -- pod status --------------------------------------------------------------------------------


def _container_status(pod: k8s.V1Pod) -> k8s.V1ContainerStatus | None:
    for cs in (pod.status.container_statuses if pod.status else None) or []:
        if cs.name == CONTAINER:
            return cs
    return None


def _describe(reason: str | None, message: str | None) -> str:
    return ": ".join(p for p in (reason, message) if p) or "no reason given"


def readiness(pod: k8s.V1Pod) -> tuple[Literal["ready", "waiting", "failed"], str]:
    """Whether a starting Pod is ready, still worth waiting for, or failed, and why."""
    status = pod.status or k8s.V1PodStatus()
    cs = _container_status(pod)
    state = cs.state if cs is not None else None
    if status.phase in ("Failed", "Succeeded"):
        why = _describe(status.reason, status.message)
        if state is not None and state.terminated is not None:
            t = state.terminated
            why += f" (container {_describe(t.reason, t.message)}, exit code {t.exit_code})"
        return "failed", f"pod {status.phase}: {why}"
    if state is not None and state.terminated is not None:
        t = state.terminated
        return "failed", f"container terminated: {_describe(t.reason, t.message)}"
    if state is not None and state.waiting is not None:
        w = state.waiting
        if w.reason in _FATAL_WAITING:
            return "failed", _describe(w.reason, w.message)
    if status.phase == "Running" and cs is not None and cs.ready:
        return "ready", ""
    for cond in status.conditions or []:
        if cond.type == "PodScheduled" and cond.status == "False":
            return "waiting", _describe(cond.reason, cond.message)
    if state is not None and state.waiting is not None:
        return "waiting", _describe(state.waiting.reason, state.waiting.message)
    return "waiting", f"phase {status.phase or 'unknown'}"


def oom_killed(pod: k8s.V1Pod) -> bool:
    """Whether the sandbox's container was killed for memory (now or before a restart)."""
    cs = _container_status(pod)
    if cs is None:
        return False
    states = (cs.state, cs.last_state)
    return any(
        s is not None and s.terminated is not None and s.terminated.reason == "OOMKilled"
        for s in states
    )


def _live(pod: k8s.V1Pod) -> bool:
    """Not failed, finished, or being deleted."""
    phase = pod.status.phase if pod.status else None
    deleting = pod.metadata is not None and pod.metadata.deletion_timestamp is not None
    return phase not in ("Failed", "Succeeded") and not deleting


def _name_labels(obj: k8s.V1Pod | k8s.V1NetworkPolicy) -> tuple[str, dict[str, str]]:
    """An API object's name and labels (empty where the server left them out)."""
    meta = obj.metadata or k8s.V1ObjectMeta()
    return meta.name or "", dict(meta.labels or {})


# -- the exec stream ---------------------------------------------------------------------------


def exit_code(status: bytes) -> int:
    """The exit code in an exec stream's status message (channel 3): ``Success`` is 0, a
    ``NonZeroExitCode`` failure carries it as the ``ExitCode`` cause. :class:`SandboxError` for
    any other failure (the command could not be run at all)."""
    try:
        doc = json.loads(status)
    except ValueError as e:
        raise SandboxError(f"unreadable exec status {status[:200]!r}") from e
    if doc.get("status") == "Success":
        return 0
    for cause in (doc.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            try:
                return int(cause.get("message"))
            except (TypeError, ValueError):
                break
    raise SandboxError(f"exec failed: {doc.get('message') or doc}")


class _ExecStream:
    """One exec WebSocket. Frames are read on one thread (:meth:`pump`); stdin may be sent from
    another (websocket-client serializes sends, its pong replies included)."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws  # kubernetes.stream.ws_client.WSClient: only its socket is used
        self._sock = ws.sock
        self.v5 = getattr(ws, "subprotocol", None) == V5

    def send_stdin(self, data: bytes) -> None:
        """Send ``data`` on the stdin channel. Raises (websocket/OS errors) once closed."""
        for i in range(0, len(data), STDIN_CHUNK):
            self._sock.send_binary(bytes([STDIN]) + data[i : i + STDIN_CHUNK])

    def close_stdin(self) -> None:
        """Close the command's stdin (``v5`` only: ``v4`` has no way to say so)."""
        if self.v5:
            self._sock.send_binary(bytes([CLOSE, STDIN]))

    def pump(
        self, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None]
    ) -> bytes | None:
        """Deliver frames until the stream ends; return the status message (channel 3), or
        ``None`` when the stream ended without one (aborted, the Pod went away)."""
        status = bytearray()
        while True:
            try:
                opcode, frame = self._sock.recv_data_frame(True)
            except (WebSocketException, OSError, AttributeError):
                break  # closed under us (abort) or by the peer without a close frame
            if opcode == ABNF.OPCODE_CLOSE:
                break
            data = frame.data
            if opcode not in (ABNF.OPCODE_BINARY, ABNF.OPCODE_TEXT) or not data:
                continue
            if isinstance(data, str):
                data = data.encode()
            channel, payload = data[0], bytes(data[1:])
            if channel == STDOUT:
                on_stdout(payload)
            elif channel == STDERR:
                on_stderr(payload)
            elif channel == ERROR:
                status += payload
        return bytes(status) if status else None

    def abort(self) -> None:
        """Wake :meth:`pump` (it returns ``None`` unless the status already came). Never raises.
        (Shutting the socket down wakes a blocked receive on another thread; closing it would
        not.)"""
        with contextlib.suppress(Exception):
            self._sock.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Release the socket; call once :meth:`pump` has returned. Never raises."""
        with contextlib.suppress(Exception):
            self._sock.shutdown()


def _in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run ``fn(*args)`` on a new daemon thread; its outcome arrives as a future of this loop.
    (Exec streams last as long as their command: the default executor is kept for short calls.)"""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn(*args))
        except BaseException as e:
            outcome = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="corral-k8s-exec", daemon=True).start()
    return fut


def _pump(
    stream: _ExecStream, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None]
) -> asyncio.Future[bytes | None]:
    """:meth:`_ExecStream.pump` on a thread of its own; the stream is closed once it ends."""
    fut = _in_thread(stream.pump, on_stdout, on_stderr)
    fut.add_done_callback(lambda _: stream.close())
    return fut


def _env_args(env: Mapping[str, str] | None) -> list[str]:
    """``env -- K=V ...`` arguments; ``ValueError`` for a name that ``env`` would misread."""
    pairs = []
    for k, v in (env or {}).items():
        if not k or "=" in k or "\0" in k + v:
            raise ValueError(f"invalid environment variable name or value: {k!r}")
        pairs.append(f"{k}={v}")
    return ["env", "--", *pairs]


def _check_cmd(cmd: Sequence[str]) -> None:
    if not cmd:
        raise ValueError("exec needs a command")
    if "=" in cmd[0]:
        raise ValueError(
            f"a command name cannot hold '=' (env would read it as a variable): {cmd[0]!r}"
        )


def _sid_file(tag: str) -> str:
    return f"{_STATE_DIR}/{tag}.sid"


def _record_session(tag: str) -> str:
    """Shell that writes the session id (the wrapper shell leads its session: ``$$``)."""
    return f"{{ mkdir -p {_STATE_DIR} && echo $$ > {_sid_file(tag)}; }} 2>/dev/null; "


def _forget_if_alone(tag: str) -> str:
    """Shell that removes the session file once the wrapper is the last of its session; a
    background process that stays keeps it (the host-side session kill still finds it)."""
    return f'[ "$(pgrep -s $$)" = "$$" ] && rm -f {_sid_file(tag)}'


def exec_argv(
    tag: str,
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str,
    timeout: float,
    stdin_len: int | None,
) -> list[str]:
    """The argv that runs ``cmd`` under the in-sandbox timeout in a session of its own; the
    wrapper shell stays (it reports a killed command as 128 + signal) and at the end removes
    its session file unless something else still runs in the session. ``stdin_len``: feed
    exactly that many bytes of the stream's stdin to the command, then end of file (``None``:
    stdin is ``/dev/null``)."""
    _check_cmd(cmd)
    run = f'timeout --kill-after=1 {timeout:.3f} "$@"'
    run = f"head -c {stdin_len} | {run}" if stdin_len is not None else f"{run} < /dev/null"
    script = (
        _record_session(tag)
        + f"cd -- {shlex.quote(cwd)} || exit 126; "
        + f"{run}; rc=$?; {_forget_if_alone(tag)}; exit $rc"
    )
    return ["setsid", "-w", "sh", "-c", script, "sh", *_env_args(env), *cmd]


def spawn_argv(
    tag: str, cmd: Sequence[str], *, env: Mapping[str, str] | None, cwd: str
) -> list[str]:
    """The argv that starts ``cmd`` in a session of its own; the wrapper writes a marker line to
    stderr just before it execs ``cmd`` (so that ``spawn`` knows it started)."""
    _check_cmd(cmd)
    script = (
        _record_session(tag)
        + f"cd -- {shlex.quote(cwd)} || exit 126; "
        + f"printf '%s\\n' {_STARTED.decode()} >&2; exec \"$@\""
    )
    return ["setsid", "-w", "sh", "-c", script, "sh", *_env_args(env), *cmd]


def kill_session_argv(tag: str) -> list[str]:
    """The argv that SIGKILLs every process of the session recorded under ``tag``."""
    sid = _sid_file(tag)
    return ["sh", "-c", f's=$(cat {sid} 2>/dev/null) && pkill -KILL -s "$s"; rm -f {sid}; true']


# -- processes and sandboxes -------------------------------------------------------------------


class KubernetesProcess(SandboxProcess):
    """A command started by :meth:`KubernetesSandbox.spawn`: an exec stream kept open. stdout
    and stderr frames arrive on the stream's reader thread and are handed to the event loop
    (:class:`~corral.sandboxes.streams.LineBuffer`); stdin is sent from a worker thread."""

    def __init__(
        self,
        stream: _ExecStream,
        kill_session: Callable[[], Any],
        on_end: Callable[[KubernetesProcess], None],
    ) -> None:
        self._stream = stream
        self._kill_session = kill_session
        self._on_end = on_end
        self._loop = asyncio.get_running_loop()
        self._out = LineBuffer()
        self._pre = bytearray()  # stderr before the start marker
        self._started = asyncio.Event()
        self._killing: asyncio.Future[None] | None = None
        self._aborted = False
        self.returncode: int | None = None  # once it ended, when the stream said
        self._pump = _pump(
            stream, self._from_thread(self._feed_out), self._from_thread(self._feed_err)
        )
        self._pump.add_done_callback(self._ended)

    def _from_thread(self, fn: Callable[[bytes], None]) -> Callable[[bytes], None]:
        def hand_over(chunk: bytes) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody reads
                self._loop.call_soon_threadsafe(fn, chunk)

        return hand_over

    def _feed_out(self, chunk: bytes) -> None:
        self._out.feed(chunk)

    def _feed_err(self, chunk: bytes) -> None:
        if self._started.is_set():
            self._out.add_stderr(chunk)
            return
        self._pre += chunk
        mark = _STARTED + b"\n"
        at = self._pre.find(mark)
        if at >= 0:
            self._started.set()
            rest = bytes(self._pre[:at] + self._pre[at + len(mark) :])
            self._pre.clear()
            if rest:
                self._out.add_stderr(rest)

    def _ended(self, fut: asyncio.Future[bytes | None]) -> None:
        if not fut.cancelled() and fut.exception() is None and (status := fut.result()):
            with contextlib.suppress(SandboxError):
                self.returncode = exit_code(status)
        self._out.close()
        self._on_end(self)
        if self._killing is None and not self._aborted:
            # It ended by itself: what it left running in its session goes too (and the
            # session file with it).
            _background(self._kill_session())

    async def wait_started(self, timeout: float) -> None:  # noqa: ASYNC109
        """Return once the command was exec'd; :class:`SandboxError` (saying why: the wrapper's
        stderr and exit code) when the stream ended first or ``timeout`` passed."""
        started: asyncio.Future[Any] = asyncio.ensure_future(self._started.wait())
        try:
            await asyncio.wait(
                {started, self._pump}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            started.cancel()
        if not self._started.is_set():
            why = self._pre.decode(errors="replace").strip() or "no output"
            if self._pump.done():
                raise SandboxError(
                    f"the command did not start (exit code {self.returncode}): {why}"
                )
            raise SandboxError(f"the command did not start within {timeout:g} s: {why}")

    async def write(self, data: bytes) -> None:
        if self._killing is not None or self._pump.done():
            raise SandboxError("the process has exited")
        try:
            await asyncio.to_thread(self._stream.send_stdin, data)
        except Exception as e:
            raise SandboxError(f"the process has exited: {e}") from e

    async def readline(self) -> bytes:
        return await self._out.readline()

    async def kill(self) -> None:
        """Kill the command's whole session inside (closing the stream alone would leave it
        running on a real cluster), then close the stream. Idempotent; never raises (a caller's
        cancellation propagates, the kill still finishes)."""
        if self._killing is None:
            self._killing = asyncio.ensure_future(self._kill())
        with contextlib.suppress(Exception):
            await asyncio.shield(self._killing)

    async def _kill(self) -> None:
        with contextlib.suppress(Exception):
            await self._kill_session()
        self._stream.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._pump), 5.0)

    def abort(self) -> None:
        """Drop the stream without killing anything inside (the sandbox is being deleted)."""
        self._aborted = True
        self._stream.abort()

    def stderr_tail(self) -> str:
        return self._out.stderr_tail()


@dataclass(slots=True)
class _Api:
    core: k8s.CoreV1Api
    net: k8s.NetworkingV1Api
    # kubernetes.stream swaps its ApiClient's call_api while it connects: streams get an
    # ApiClient of their own (so concurrent plain calls are unaffected) and connect one at a time.
    stream_core: k8s.CoreV1Api
    stream_lock: threading.Lock


_OOM_CONTAINER = "memory: the container was OOM-killed (the sandbox is gone)"


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
    """One Pod. Everything goes through the provider's API clients; see the module docstring."""

    def __init__(
        self, provider: KubernetesProvider, name: str, spec: SandboxSpec, pod_ip: str | None
    ):
        self.id = name
        self._provider = provider
        self._spec = spec
        self._pod_ip = pod_ip
        self._oom_seen = 0
        self._processes: set[KubernetesProcess] = set()

    # -- streams ------------------------------------------------------------------------------

    async def _open(self, argv: list[str], *, stdin: bool) -> _ExecStream:
        """Connect an exec stream for ``argv``. :class:`SandboxError` once closed, when the
        API refuses (Pod gone, not running) or does not answer within ``API_TIMEOUT_S``. A
        stream that connects after the caller gave up is closed at once."""
        if self._closing is not None:
            raise SandboxError(f"kubernetes sandbox {self.id} is closed")
        fut = asyncio.ensure_future(
            asyncio.to_thread(self._provider._connect, self.id, argv, stdin)
        )
        try:
            return await asyncio.wait_for(asyncio.shield(fut), API_TIMEOUT_S)
        except TimeoutError:
            fut.add_done_callback(_close_stream)
            raise SandboxError(
                f"kubernetes sandbox {self.id}: the exec stream did not connect within "
                f"{API_TIMEOUT_S:g} s"
            ) from None
        except asyncio.CancelledError:
            fut.add_done_callback(_close_stream)
            raise

    async def _raw(self, argv: list[str], timeout: float) -> tuple[int, bytes, bytes]:  # noqa: ASYNC109
        """Run ``argv`` as is (no wrapper, no stdin); ``timeout`` bounds the wait, not the
        command. :class:`SandboxError` when it cannot be run or does not answer in time."""
        stream = await self._open(argv, stdin=False)
        out, err = bytearray(), bytearray()
        pump = _pump(stream, out.extend, err.extend)
        try:
            status = await asyncio.wait_for(asyncio.shield(pump), timeout)
        except TimeoutError:
            stream.abort()
            raise SandboxError(f"kubernetes sandbox {self.id}: {argv[0]} did not answer") from None
        except BaseException:
            stream.abort()
            raise
        if status is None:
            raise SandboxError(f"kubernetes sandbox {self.id}: exec ended without a status")
        return exit_code(status), bytes(out), bytes(err)

    async def _kill_session(self, tag: str) -> None:
        """SIGKILL what runs in the session recorded under ``tag``. Never raises."""
        try:
            await self._raw(kill_session_argv(tag), KILL_TIMEOUT_S)
        except Exception as e:
            log.debug("kubernetes sandbox %s: session kill %s failed: %s", self.id, tag, e)

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
            pod = await self._provider._read_pod(self.id)
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
        """Run ``cmd`` wrapped (:func:`exec_argv`) and enforce both timeouts; the raw outcome.
        :class:`SandboxError` when the stream cannot be opened."""
        t = max(float(timeout), 0.001)
        tag = uuid.uuid4().hex[:12]
        argv = exec_argv(
            tag,
            cmd,
            env=env,
            cwd=cwd or self._spec.workdir,
            timeout=t,
            stdin_len=len(stdin) if stdin is not None else None,
        )
        started = time.monotonic()
        stream = await self._open(argv, stdin=stdin is not None)
        out, err = bytearray(), bytearray()
        pump = _pump(stream, out.extend, err.extend)
        if stdin is not None:
            # From a thread of its own: a command that writes much before it reads its stdin
            # must not deadlock against a sender blocked on a full connection.
            _in_thread(_send_all, stream, stdin)
        host_killed = False
        try:
            try:
                status = await asyncio.wait_for(asyncio.shield(pump), t + 1.0 + HOST_GRACE_S)
            except TimeoutError:
                host_killed = True
                await self._kill_session(tag)
                try:
                    status = await asyncio.wait_for(asyncio.shield(pump), KILL_TIMEOUT_S)
                except TimeoutError:
                    stream.abort()
                    status = await pump
        except BaseException:
            # Cancelled: the command must not outlive its caller (closing the stream does not
            # stop it on a real cluster).
            stream.abort()
            _background(self._kill_session(tag))
            raise
        elapsed = time.monotonic() - started
        if status is None and not host_killed:
            lost = "the exec stream ended without an exit status"
            return _Outcome(137, bytes(out), bytes(err), timed_out=False, lost=lost)
        try:
            code = exit_code(status) if status is not None else 137
        except SandboxError as e:  # a failure without an exit code: the command never ran
            return _Outcome(137, bytes(out), bytes(err), timed_out=False, lost=str(e))
        timed_out = host_killed or code == 124 or (code == 137 and elapsed >= t)
        if timed_out and not host_killed:
            # What left timeout's process group (setpgid) is still in the session: kill it.
            await self._kill_session(tag)
        return _Outcome(code, bytes(out), bytes(err), timed_out=timed_out, lost=None)

    async def _oom_reason(self) -> str | None:
        """Why a command died of SIGKILL, when memory was the cause: the container's status
        (cgroup v2 nodes kill the whole container, ``memory.oom.group``), else the memory
        cgroup's OOM-kill counter as seen inside (only the command was killed)."""
        pod = await self._provider._read_pod(self.id)
        if pod is not None and oom_killed(pod):
            return _OOM_CONTAINER
        if pod is None or not _live(pod):
            return None
        script = (
            "cat /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control "
            "2>/dev/null; true"
        )
        try:
            _, text, _ = await self._raw(["sh", "-c", script], KILL_TIMEOUT_S)
        except SandboxError:
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
        tag = uuid.uuid4().hex[:12]
        argv = spawn_argv(tag, cmd, env=env, cwd=cwd or self._spec.workdir)
        stream = await self._open(argv, stdin=True)
        proc = KubernetesProcess(stream, lambda: self._kill_session(tag), self._processes.discard)
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
            pod = await self._provider._read_pod(self.id)
            self._pod_ip = pod.status.pod_ip if pod is not None and pod.status else None
        if self._pod_ip is None:
            raise SandboxError(f"kubernetes sandbox {self.id} has no pod IP")
        return Endpoint(self._pod_ip, port)

    async def is_alive(self) -> bool:
        """Whether the Pod exists and runs (not failed, finished or being deleted)."""
        try:
            pod = await self._provider._read_pod(self.id)
            return (
                pod is not None
                and pod.status is not None
                and pod.status.phase == "Running"
                and _live(pod)
            )
        except Exception:
            return False

    async def _close(self) -> None:
        for proc in list(self._processes):
            proc.abort()  # their processes die with the Pod
        await self._provider._delete(self.id)


def _send_all(stream: _ExecStream, data: bytes) -> None:
    """Send ``data`` as stdin then close it; a stream closed meanwhile is fine (the command
    ended or was killed: its exit status says so)."""
    with contextlib.suppress(Exception):
        stream.send_stdin(data)
        stream.close_stdin()


def _close_stream(fut: asyncio.Future[_ExecStream]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        s = fut.result()
        s.abort()
        s.close()


_background_tasks: set[asyncio.Task[None]] = set()


def _background(coro: Any) -> None:
    """Run ``coro`` to its end even though nobody awaits it (kept referenced until then)."""
    task = asyncio.ensure_future(coro)
    _background_tasks.add(task)
    task.add_done_callback(_background_tasks.discard)


def _api_error(e: ApiException) -> str:
    """The API server's own message for a failed call, when its body holds one."""
    try:
        message = json.loads(e.body or "").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"{e.status} {message or e.reason or ''}".strip()


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
        self._api: _Api | None = None
        self._warned_pids = False

    # -- API plumbing -------------------------------------------------------------------------

    async def _apis(self) -> _Api:
        """The API objects, made on first use (loading a kubeconfig reads files and may run an
        auth plugin: off the event loop). :class:`SandboxError` without a configuration."""
        if self._api is None:
            client = self._api_client
            if client is None:
                # (Two first calls at once may both load it; the later one wins, harmlessly.)
                client = await asyncio.to_thread(_default_api_client)
                self._api_client = client
            if self._api is None:
                self._api = _Api(
                    core=k8s.CoreV1Api(client),
                    net=k8s.NetworkingV1Api(client),
                    stream_core=k8s.CoreV1Api(k8s.ApiClient(client.configuration)),
                    stream_lock=threading.Lock(),
                )
        return self._api

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(*args, **kw)`` on a worker thread with a request timeout; :class:`SandboxError`
        naming ``what`` when the API refuses or cannot be reached."""
        try:
            return await asyncio.to_thread(fn, *args, _request_timeout=API_TIMEOUT_S, **kw)
        except ApiException as e:
            raise SandboxError(f"kubernetes: {what} failed: {_api_error(e)}") from e
        except Exception as e:  # connection refused, timeouts, bad answers
            raise SandboxError(f"kubernetes: {what} failed: {e}") from e

    def _connect(self, name: str, argv: list[str], stdin: bool) -> _ExecStream:
        """(worker thread) Open an exec stream to Pod ``name``. :class:`SandboxError` when the
        API refuses (a missing or stopped Pod answers the handshake with an error)."""
        api = self._api
        assert api is not None, "a sandbox exists only after _apis()"
        try:
            with api.stream_lock:
                ws = k8s_stream(
                    api.stream_core.connect_get_namespaced_pod_exec,
                    name,
                    self.namespace,
                    command=argv,
                    container=CONTAINER,
                    stdin=stdin,
                    stdout=True,
                    stderr=True,
                    tty=False,
                    binary=True,
                    _preload_content=False,
                )
        except ApiException as e:
            raise SandboxError(f"kubernetes sandbox {name}: exec refused: {_api_error(e)}") from e
        except Exception as e:
            raise SandboxError(f"kubernetes sandbox {name}: exec failed: {e}") from e
        return _ExecStream(ws)

    async def _read_pod(self, name: str) -> k8s.V1Pod | None:
        """The Pod, or ``None`` when it does not exist. :class:`SandboxError` on API errors."""
        api = await self._apis()
        try:
            return await asyncio.to_thread(
                api.core.read_namespaced_pod, name, self.namespace, _request_timeout=API_TIMEOUT_S
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise SandboxError(f"kubernetes: reading pod {name} failed: {_api_error(e)}") from e
        except Exception as e:
            raise SandboxError(f"kubernetes: reading pod {name} failed: {e}") from e

    async def _delete(self, name: str) -> None:
        """Delete Pod ``name`` (grace period 0) and its NetworkPolicy; absent ones are fine.
        Both are attempted; then :class:`SandboxError` naming what failed, if anything did."""
        api = await self._apis()
        now = k8s.V1DeleteOptions(grace_period_seconds=0, propagation_policy="Background")
        calls: list[tuple[str, Callable[..., Any]]] = [
            (f"deleting pod {name}", api.core.delete_namespaced_pod),
            (f"deleting network policy {name}", api.net.delete_namespaced_network_policy),
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
                    errors.append(f"{what} failed: {_api_error(e)}")
            except Exception as e:
                errors.append(f"{what} failed: {e}")
        if errors:
            raise SandboxError(f"kubernetes: {'; '.join(errors)}")

    # -- create -------------------------------------------------------------------------------

    def _labels(self, name: str, spec: SandboxSpec) -> dict[str, str]:
        labels = {}
        for key, value in spec.labels.items():
            _check_label_key(key)
            labels[key] = label_value(value)
        labels.update({key: label_value(v) for key, v in owner_labels(spec.ttl_s).items()})
        labels.update({OWNER_LABEL: self._owner_value, SANDBOX_LABEL: name})
        return labels

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
        name = f"corral-{_name_part(self.owner)}-{uuid.uuid4().hex[:12]}"
        labels = self._labels(name, spec)
        pod = pod_manifest(name, labels, spec, spec.image or self.image)
        try:
            made = await self._call(
                f"creating pod {name}", api.core.create_namespaced_pod, self.namespace, pod
            )
            uid = made.metadata.uid if made.metadata else None
            if not uid:
                raise SandboxError(f"kubernetes: the created pod {name} has no uid")
            await self._call(
                f"creating network policy {name}",
                api.net.create_namespaced_network_policy,
                self.namespace,
                policy_manifest(name, labels, uid, rules),
            )
            ready = await self._wait_ready(name)
        except BaseException as e:
            # Everything made is labelled; delete it now (a crash here leaves it to sweep).
            with contextlib.suppress(Exception):
                await asyncio.shield(self._delete(name))
            if isinstance(e, SandboxError):
                raise
            if isinstance(e, Exception):
                raise SandboxError(f"kubernetes sandbox could not be created: {e}") from e
            raise
        pod_ip = ready.status.pod_ip if ready.status else None
        return KubernetesSandbox(self, name, spec, pod_ip)

    async def _wait_ready(self, name: str) -> k8s.V1Pod:
        """Poll Pod ``name`` until it is ready. :class:`SandboxError` with the Pod's reason when
        it failed, or with what it was waiting for when ``start_timeout`` passed."""
        deadline = time.monotonic() + self.start_timeout
        delay = 0.05
        while True:
            pod = await self._read_pod(name)
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
        pods = await self._call(
            "listing pods",
            api.core.list_namespaced_pod,
            self.namespace,
            label_selector=f"{OWNER_LABEL}={self._owner_value}",
        )
        return sorted(_name_labels(p)[0] for p in pods.items if _live(p))

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
        policies = await self._call(
            "listing network policies",
            api.net.list_namespaced_network_policy,
            self.namespace,
            label_selector=selector,
        )
        pods = await self._call(
            "listing pods", api.core.list_namespaced_pod, self.namespace, label_selector=selector
        )
        now = time.time()
        gone: set[str] = set()
        pod_names = set()
        for pod in pods.items:
            name, labels = _name_labels(pod)
            pod_names.add(name)
            stale = owner_gone(labels) or expired(labels, now) or not _live(pod)
            if stale and await self._sweep_one(name):
                gone.add(name)
        for policy in policies.items:
            name, labels = _name_labels(policy)
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
            await self._delete(name)
        except SandboxError as e:
            log.warning("kubernetes sweep: %s", e)
            return False
        return True
