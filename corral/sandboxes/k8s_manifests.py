"""The Kubernetes objects of a sandbox (:mod:`corral.sandboxes.kubernetes`): its labels, its
Pod and NetworkPolicy, and what a Pod's status says (ready, worth waiting for, failed, live).

Pure functions of a :class:`~corral.sandboxes.base.SandboxSpec` and of API objects: no API call
is made here. The docstring of :mod:`corral.sandboxes.kubernetes` says why each field of the
manifests is what it is.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from hashlib import sha256
from typing import Literal

from kubernetes import client as k8s

from corral.sandboxes.base import (
    OWNER_LABEL,
    SANDBOX_LABEL,
    NetworkPolicy,
    SandboxError,
    SandboxSpec,
)
from corral.sandboxes.ownership import owner_labels

CONTAINER = "sandbox"
UID = 1000
DEFAULT_MEMORY_MB = 1024
DEFAULT_CPUS = 1.0
DEFAULT_DISK_MB = 256
TMP_MB = 64
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

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


def check_label_key(key: str) -> None:
    """:class:`SandboxError` unless ``key`` is a valid label key (``[prefix/]name``)."""
    prefix, _, name = key.rpartition("/")
    ok = len(name) <= 63 and _LABEL_NAME.match(name) is not None
    if prefix:
        ok = ok and len(prefix) <= 253 and all(_DNS_LABEL.match(p) for p in prefix.split("."))
    if not ok:
        raise SandboxError(f"{key!r} is not a valid Kubernetes label key")


def name_part(owner: str) -> str:
    """A DNS-label-safe slug of ``owner`` for Pod names (readability only: not unique)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", owner.lower()).strip("-")[:30].strip("-")
    return slug or "sandbox"


def sandbox_labels(owner_value: str, name: str, spec: SandboxSpec) -> dict[str, str]:
    """The labels of sandbox ``name``'s Pod and policy: ``spec.labels`` (keys checked, values
    made valid), the owner's process labels, and ``corral.owner`` = ``owner_value`` (already a
    label value) and ``corral.sandbox`` = ``name``, which ``spec.labels`` cannot override.
    :class:`SandboxError` for an invalid key."""
    labels = {}
    for key, value in spec.labels.items():
        check_label_key(key)
        labels[key] = label_value(value)
    labels.update({key: label_value(v) for key, v in owner_labels(spec.ttl_s).items()})
    labels.update({OWNER_LABEL: owner_value, SANDBOX_LABEL: name})
    return labels


# -- manifests ---------------------------------------------------------------------------------


def pod_manifest(name: str, labels: Mapping[str, str], spec: SandboxSpec, image: str) -> k8s.V1Pod:
    """The Pod for one sandbox (the docstring of :mod:`corral.sandboxes.kubernetes` says why)."""
    memory = spec.memory_mb or DEFAULT_MEMORY_MB
    disk = spec.disk_mb or DEFAULT_DISK_MB
    cpus = spec.cpus or DEFAULT_CPUS
    limits = {
        "cpu": f"{max(1, round(cpus * 1000))}m",
        "memory": f"{memory}Mi",
        "ephemeral-storage": f"{disk + TMP_MB}Mi",
    }
    env = {"PATH": PATH, "HOME": spec.workdir, "LANG": "C.UTF-8"} | dict(spec.env)
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


def live(pod: k8s.V1Pod) -> bool:
    """Not failed, finished, or being deleted."""
    phase = pod.status.phase if pod.status else None
    deleting = pod.metadata is not None and pod.metadata.deletion_timestamp is not None
    return phase not in ("Failed", "Succeeded") and not deleting


def name_labels(obj: k8s.V1Pod | k8s.V1NetworkPolicy) -> tuple[str, dict[str, str]]:
    """An API object's name and labels (empty where the server left them out)."""
    meta = obj.metadata or k8s.V1ObjectMeta()
    return meta.name or "", dict(meta.labels or {})
