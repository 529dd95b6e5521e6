"""The kubernetes sandbox backend, through the real ``kubernetes`` client library.

Where: the STAND-IN API server of :mod:`tests.k8s_standin` (test code: no Kubernetes API server
can run on this machine) started on 127.0.0.1, whose Pods run as real bwrap sandboxes so that
exec is real; or, when ``CORRAL_K8S_KUBECONFIG`` names a kubeconfig, that cluster instead
(``CORRAL_K8S_NAMESPACE``, default ``default``; ``CORRAL_K8S_IMAGE``, default
``corral-sandbox:py3``, which the cluster must be able to pull or already hold: see
docs/kubernetes.md). Tests that inspect what the stand-in received (the Pod and NetworkPolicy
objects, the requests) skip on a real cluster; the others run on both.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from corral.sandboxes.base import (
    OWNER_LABEL,
    SANDBOX_LABEL,
    Bind,
    Endpoint,
    NetworkPolicy,
    SandboxError,
    SandboxSpec,
)
from corral.sandboxes.image import DEFAULT_TAG
from corral.sandboxes.k8s_exec import exit_code
from corral.sandboxes.k8s_manifests import label_value, pod_manifest
from corral.sandboxes.kubernetes import KubernetesProvider, KubernetesSandbox
from corral.sandboxes.ownership import (
    BOOT_LABEL,
    EXPIRES_LABEL,
    HOST_LABEL,
    PID_LABEL,
    START_LABEL,
    boot_id,
)
from corral.sandboxes.records import process_start_time
from tests.k8s_standin import V4, V5, StandIn

ROOT = Path(__file__).resolve().parent.parent
KUBECONFIG = os.environ.get("CORRAL_K8S_KUBECONFIG")
NAMESPACE = os.environ.get("CORRAL_K8S_NAMESPACE", "default")
IMAGE = os.environ.get("CORRAL_K8S_IMAGE", DEFAULT_TAG)
SERVER_CIDR = "10.0.0.7/32"  # the env server's address the loopback policies name

standin_only = pytest.mark.skipif(
    KUBECONFIG is not None, reason="inspects what the stand-in API server received"
)
# Every test here can run against a real cluster (docs/kubernetes.md), but the standin_only ones.
pytestmark = [pytest.mark.timeout(120), pytest.mark.k8s_cluster]


def _has_seccomp() -> bool:
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@dataclass
class Cluster:
    """Where the tests run: the stand-in (``standin`` set) or a real cluster."""

    standin: StandIn | None

    def api_client(self) -> k8s.ApiClient:
        if self.standin is None:
            from kubernetes import config

            return config.new_client_from_config(config_file=KUBECONFIG, persist_config=False)
        return k8s.ApiClient(k8s.Configuration(host=self.standin.url))

    def child_target(self) -> str:
        """How a child process reaches the same API (see :data:`CHILD`)."""
        return f"kubeconfig:{KUBECONFIG}" if self.standin is None else self.standin.url


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if KUBECONFIG is not None:
        yield Cluster(None)
        return
    if shutil.which("bwrap") is None or not _has_seccomp():
        pytest.skip(
            "the stand-in runs Pods in bwrap: apt-get install bubblewrap, pip install pyseccomp"
        )
    standin = StandIn(tmp_path_factory.mktemp("k8s-standin"), images=(IMAGE,))
    standin.start()
    yield Cluster(standin)
    standin.stop()


@pytest.fixture
def standin(cluster: Cluster) -> StandIn:
    assert cluster.standin is not None
    return cluster.standin


def _provider(cluster: Cluster, owner: str | None = None, **kw: Any) -> KubernetesProvider:
    options: dict[str, Any] = {"env_server_cidr": SERVER_CIDR, "server_port": 8000}
    options |= {"start_timeout": 60.0} | kw
    return KubernetesProvider(
        owner or f"test-{uuid.uuid4().hex[:8]}",
        namespace=NAMESPACE,
        image=IMAGE,
        api_client=cluster.api_client(),
        **options,
    )


async def _cleanup(cluster: Cluster, owner: str) -> None:
    """Delete whatever ``owner`` left (a failing test must not leak Pods into the next)."""
    core, net = _apis(cluster)
    selector = f"{OWNER_LABEL}={label_value(owner)}"
    pods = await asyncio.to_thread(core.list_namespaced_pod, NAMESPACE, label_selector=selector)
    nps = await asyncio.to_thread(
        net.list_namespaced_network_policy, NAMESPACE, label_selector=selector
    )
    for name in _names(pods.items) | _names(nps.items):
        await _delete_raw(cluster, name)


def _names(items: list[Any]) -> set[str]:
    """The names of listed API objects."""
    return {o.metadata.name for o in items if o.metadata is not None and o.metadata.name}


@pytest.fixture
async def provider(cluster: Cluster) -> AsyncIterator[KubernetesProvider]:
    p = _provider(cluster)
    yield p
    await _cleanup(cluster, p.owner)
    if cluster.standin is not None:
        assert cluster.standin.unexpected == [], "the backend made a call the stand-in lacks"


@pytest.fixture
async def sandbox(provider: KubernetesProvider) -> AsyncIterator[KubernetesSandbox]:
    sb = await provider.create(SandboxSpec(env={"A": "1"}, ttl_s=600))
    yield sb
    await sb.close()


def _apis(cluster: Cluster) -> tuple[k8s.CoreV1Api, k8s.NetworkingV1Api]:
    api = cluster.api_client()
    return k8s.CoreV1Api(api), k8s.NetworkingV1Api(api)


async def _read_pod(cluster: Cluster, name: str) -> k8s.V1Pod | None:
    core, _ = _apis(cluster)
    try:
        return await asyncio.to_thread(core.read_namespaced_pod, name, NAMESPACE)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


async def _policy_names(cluster: Cluster, owner: str | None = None) -> set[str]:
    _, net = _apis(cluster)
    selector = f"{OWNER_LABEL}={label_value(owner)}" if owner else OWNER_LABEL
    found = await asyncio.to_thread(
        net.list_namespaced_network_policy, NAMESPACE, label_selector=selector
    )
    return _names(found.items)


async def _pod_names(cluster: Cluster, owner: str) -> set[str]:
    core, _ = _apis(cluster)
    selector = f"{OWNER_LABEL}={label_value(owner)}"
    found = await asyncio.to_thread(core.list_namespaced_pod, NAMESPACE, label_selector=selector)
    return _names(found.items)


async def _delete_raw(cluster: Cluster, name: str) -> None:
    core, net = _apis(cluster)
    for fn in (core.delete_namespaced_pod, net.delete_namespaced_network_policy):
        try:
            await asyncio.to_thread(fn, name, NAMESPACE, grace_period_seconds=0)
        except ApiException as e:
            if e.status != 404:
                raise


async def _phase_becomes(cluster: Cluster, name: str, phase: str, timeout: float) -> bool:  # noqa: ASYNC109
    """Whether Pod ``name`` reaches ``phase`` within ``timeout`` (the stand-in signals each
    change; a real cluster is polled)."""
    if cluster.standin is not None:
        st = cluster.standin

        def reached(s: StandIn) -> bool:
            return ((s.pod(name, NAMESPACE) or {}).get("status") or {}).get("phase") == phase

        return await asyncio.to_thread(st.wait_for, reached, timeout)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pod = await _read_pod(cluster, name)
        if pod is not None and pod.status is not None and pod.status.phase == phase:
            return True
        await asyncio.sleep(0.5)
    return False


def _commands(ps_output: str) -> list[str]:
    """The command lines in ``ps -eo args`` output."""
    return [line.strip() for line in ps_output.splitlines()[1:]]


# ---- exec -----------------------------------------------------------------------------------


async def test_exec_output_exit_code_env_cwd_and_stdin(sandbox: KubernetesSandbox) -> None:
    r = await sandbox.exec(
        ["sh", "-c", 'echo "$A-$B"; echo oops >&2; pwd; id -u; exit 3'],
        timeout=10,
        env={"B": "2"},
        cwd="/tmp",
    )
    assert (r.exit_code, r.stdout, r.stderr) == (3, "1-2\n/tmp\n1000\n", "oops\n")
    assert not r.timed_out and not r.killed
    r = await sandbox.exec(["pwd"], timeout=10)
    assert (r.exit_code, r.stdout) == (0, "/work\n")
    text = "héllo\nwörld\n" * 1000
    r = await sandbox.exec(["sh", "-c", "cat; echo end"], timeout=10, stdin=text.encode())
    assert r.stdout == text + "end\n"
    r = await sandbox.exec(["no-such-command-xyz"], timeout=10)
    assert r.exit_code == 127 and "no-such-command-xyz" in r.stderr
    r = await sandbox.exec(["true"], timeout=10, cwd="/no/such/dir")
    assert r.exit_code == 126 and "/no/such/dir" in r.stderr


@standin_only
async def test_exec_stdin_on_a_v4_server(sandbox: KubernetesSandbox, standin: StandIn) -> None:
    """v4 cannot close a stream's stdin: the length-framed stdin still ends where it should."""
    await sandbox.exec(["true"], timeout=10)
    assert standin.execs[-1][1] == V5  # what the client negotiates by default
    standin.protocols = (V4,)
    try:
        data = os.urandom(1_000_000)
        r = await sandbox.exec(["sh", "-c", "wc -c; echo done"], timeout=10, stdin=data)
        assert r.stdout.split() == ["1000000", "done"]
        assert standin.execs[-1][1] == V4
    finally:
        standin.protocols = (V5, V4)


async def test_timeout_kills_the_whole_tree(sandbox: KubernetesSandbox) -> None:
    # The second sleep moves to a process group of its own (setpgid): timeout's group kill
    # misses it, the session kill does not.
    own_group = "import os; os.setpgid(0, 0); os.execvp('sleep', ['sleep', '102'])"
    script = f'sleep 101 & python3 -c "{own_group}" >/dev/null 2>&1 & sleep 103; echo x'
    started = time.monotonic()
    r = await sandbox.exec(["sh", "-c", script], timeout=1)
    elapsed = time.monotonic() - started
    assert r.timed_out and r.reason == "timeout" and "x" not in r.stdout
    assert elapsed < 4, elapsed  # the in-sandbox timeout ended it, not the host's grace
    ps = await sandbox.exec(["ps", "-eo", "args"], timeout=10)
    assert not [c for c in _commands(ps.stdout) if c.startswith("sleep 10")]


async def test_a_process_holding_stdout_cannot_hang_exec(sandbox: KubernetesSandbox) -> None:
    """The command exits but leaves a child holding stdout, so the stream never ends: the
    host-side session kill ends it after the timeout and its grace."""
    started = time.monotonic()
    r = await sandbox.exec(["sh", "-c", "sleep 104 & echo started"], timeout=0.5)
    assert r.timed_out and r.stdout == "started\n"
    assert time.monotonic() - started < 0.5 + 1 + 3 + 3
    ps = await sandbox.exec(["ps", "-eo", "args"], timeout=10)
    assert "sleep 104" not in _commands(ps.stdout)


async def test_memory_hog_is_reported_killed(
    provider: KubernetesProvider, cluster: Cluster
) -> None:
    if cluster.standin is not None and not os.access("/sys/fs/cgroup/memory", os.W_OK):
        pytest.skip("the stand-in enforces memory limits through cgroup v1 (needs root)")
    sb = await provider.create(SandboxSpec(memory_mb=64))
    try:
        r = await sb.exec(["python3", "-c", "b = bytearray(400 * 2**20)"], timeout=30)
        assert r.exit_code == 137 and r.killed and not r.timed_out
        assert r.reason is not None and r.reason.startswith("memory"), r
        if cluster.standin is not None:  # as on cgroup-v2 nodes: the whole container died
            assert not await sb.is_alive()
    finally:
        await sb.close()


# ---- files ----------------------------------------------------------------------------------


async def test_files_round_trip(sandbox: KubernetesSandbox) -> None:
    data = bytes(range(256)) * 4096  # every byte value, 1 MiB
    await sandbox.write_file("/work/deep/er/f.bin", data)
    assert await sandbox.read_file("deep/er/f.bin") == data
    await sandbox.write_file("rel.txt", b"relative")
    r = await sandbox.exec(["cat", "/work/rel.txt"], timeout=10)
    assert r.stdout == "relative"
    await sandbox.write_file("/tmp/t/empty", b"")
    assert await sandbox.read_file("/tmp/t/empty") == b""
    with pytest.raises(SandboxError, match="no such file"):
        await sandbox.read_file("missing.txt")
    with pytest.raises(SandboxError, match="cannot read"):
        await sandbox.read_file("/work/deep")  # a folder
    with pytest.raises(SandboxError, match="cannot write"):
        await sandbox.write_file("/usr/x", b"read-only root")


# ---- spawn ----------------------------------------------------------------------------------

ECHO_UPPER = """
import sys
for line in sys.stdin:
    if line.strip() == "quit":
        print("bye", file=sys.stderr)
        sys.exit(0)
    print("got", line.strip(), file=sys.stderr, flush=True)
    print(line.strip().upper(), flush=True)
"""


async def test_spawn_lines_stderr_and_exit(sandbox: KubernetesSandbox) -> None:
    proc = await sandbox.spawn(["python3", "-u", "-c", ECHO_UPPER])
    await proc.write(b"abc\n")
    assert await proc.readline() == b"ABC\n"
    await proc.write(b"d\ne\n")
    assert [await proc.readline(), await proc.readline()] == [b"D\n", b"E\n"]
    await proc.write(b"quit\n")
    assert await proc.readline() == b""  # it exited: the stream ended, every frame delivered
    assert "got abc" in proc.stderr_tail() and "bye" in proc.stderr_tail()
    assert "corral-spawn-started" not in proc.stderr_tail()
    assert getattr(proc, "returncode", None) == 0
    with pytest.raises(SandboxError):
        await proc.write(b"more\n")
    await proc.kill()  # after exit: still fine


async def test_spawn_that_cannot_start_says_why(sandbox: KubernetesSandbox) -> None:
    with pytest.raises(SandboxError, match="/no/such/dir"):
        await sandbox.spawn(["cat"], cwd="/no/such/dir")


async def test_many_open_streams_do_not_starve_exec(sandbox: KubernetesSandbox) -> None:
    """Each stream has a thread of its own: more open processes than the default executor has
    threads leave exec and the API calls working."""
    procs = [await sandbox.spawn(["cat"]) for _ in range(12)]
    try:
        r = await asyncio.wait_for(sandbox.exec(["echo", "still here"], timeout=10), 30)
        assert r.stdout == "still here\n"
        for i, p in enumerate(procs):
            await p.write(f"{i}\n".encode())
        assert [await p.readline() for p in procs] == [f"{i}\n".encode() for i in range(12)]
        assert await sandbox.is_alive()
    finally:
        await asyncio.gather(*(p.kill() for p in procs))


# ---- what is sent ---------------------------------------------------------------------------


@standin_only
async def test_the_pod_spec(provider: KubernetesProvider, standin: StandIn) -> None:
    spec = SandboxSpec(
        cpus=0.5, memory_mb=256, disk_mb=100, ttl_s=600, env={"K": "v"},
        labels={"episode": "ep 1/2", "corral.owner": "forged"},
    )  # fmt: skip
    before = time.time()
    sb = await provider.create(spec)
    try:
        pod = standin.received("pods", sb.id)
    finally:
        await sb.close()
    labels = pod["metadata"]["labels"]
    assert labels[OWNER_LABEL] == provider.owner  # spec.labels cannot forge ownership
    assert labels[SANDBOX_LABEL] == sb.id == pod["metadata"]["name"]
    assert labels[HOST_LABEL] == socket.gethostname()
    assert labels[BOOT_LABEL] == boot_id()
    assert labels[PID_LABEL] == str(os.getpid())
    assert labels[START_LABEL] == str(process_start_time(os.getpid()))
    assert before + 600 - 0.001 <= float(labels[EXPIRES_LABEL]) <= time.time() + 600  # ms
    assert labels["episode"] == label_value("ep 1/2") != "ep 1/2"
    s = pod["spec"]
    assert s["automountServiceAccountToken"] is False
    assert s["enableServiceLinks"] is False
    assert s["shareProcessNamespace"] is True
    assert s["restartPolicy"] == "Never"
    assert s["activeDeadlineSeconds"] == 600
    assert s["securityContext"]["runAsNonRoot"] is True
    (c,) = s["containers"]
    assert c["image"] == IMAGE and c["command"] == ["sleep", "601"]
    limits = {"cpu": "500m", "memory": "256Mi", "ephemeral-storage": "164Mi"}
    assert c["resources"] == {"limits": limits, "requests": limits}
    assert c["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert {"name": "K", "value": "v"} in c["env"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"work": "/work", "tmp": "/tmp"}
    sizes = {v["name"]: v["emptyDir"]["sizeLimit"] for v in s["volumes"]}
    assert sizes == {"work": "100Mi", "tmp": "64Mi"}


async def _policy_of(
    provider: KubernetesProvider, standin: StandIn, net: NetworkPolicy
) -> dict[str, Any]:
    sb = await provider.create(SandboxSpec(network=net))
    try:
        policy = standin.received("networkpolicies", sb.id)
        uid = standin.pod(sb.id, NAMESPACE)["metadata"]["uid"]  # type: ignore[index]
    finally:
        await sb.close()
    meta = policy["metadata"]
    assert meta["name"] == sb.id and meta["labels"][OWNER_LABEL] == provider.owner
    assert meta["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": sb.id, "uid": uid, "controller": False}
    ]
    assert policy["spec"]["podSelector"] == {"matchLabels": {SANDBOX_LABEL: sb.id}}
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    return dict(policy["spec"])


@standin_only
async def test_network_policies(provider: KubernetesProvider, standin: StandIn) -> None:
    spec = await _policy_of(provider, standin, NetworkPolicy())
    assert (spec["ingress"], spec["egress"]) == ([], [])  # deny all, both ways

    spec = await _policy_of(provider, standin, NetworkPolicy(mode="loopback"))
    server = {"ipBlock": {"cidr": SERVER_CIDR}}
    assert spec["ingress"] == [{"from": [server]}]
    dns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}
    assert spec["egress"] == [
        {"to": [server], "ports": [{"protocol": "TCP", "port": 8000}]},
        {"to": [dns], "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
    ]
    spec = await _policy_of(provider, standin, NetworkPolicy(mode="loopback", server_port=9000))
    assert spec["egress"][0]["ports"] == [{"protocol": "TCP", "port": 9000}]

    allow = NetworkPolicy(mode="allowlist", allow=("192.0.2.0/24", "2001:db8::1"))
    spec = await _policy_of(provider, standin, allow)
    blocks = [{"ipBlock": {"cidr": "192.0.2.0/24"}}, {"ipBlock": {"cidr": "2001:db8::1/128"}}]
    assert spec["ingress"] == [] and spec["egress"] == [{"to": blocks}]  # no DNS either


@standin_only
async def test_close_deletes_pod_and_policy_explicitly(
    provider: KubernetesProvider, standin: StandIn
) -> None:
    sb = await provider.create(SandboxSpec())
    await sb.close()
    deletes = [(r.path, r.query, r.body) for r in standin.requests() if r.method == "DELETE"]
    pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods/{sb.id}"
    np_path = f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies/{sb.id}"
    assert [d[0] for d in deletes if sb.id in d[0]] == [pod_path, np_path]
    query, body = next((q, b) for p, q, b in deletes if p == pod_path)
    assert ("gracePeriodSeconds", "0") in query and body["gracePeriodSeconds"] == 0


async def test_refused_specs_create_nothing(cluster: Cluster, provider: KubernetesProvider) -> None:
    calls = len(cluster.standin.requests()) if cluster.standin else 0
    with pytest.raises(SandboxError, match="host paths"):
        await provider.create(SandboxSpec(binds=(Bind(source=Path("/etc"), target="/x"),)))
    with pytest.raises(SandboxError, match="hostnames"):
        await provider.create(
            SandboxSpec(network=NetworkPolicy(mode="allowlist", allow=("10.1.2.3", "pypi.org")))
        )
    with pytest.raises(SandboxError, match="rootfs"):
        await provider.create(SandboxSpec(rootfs=Path("/")))
    no_server = _provider(cluster, provider.owner, env_server_cidr=None)
    with pytest.raises(SandboxError, match="env_server_cidr"):
        await no_server.create(SandboxSpec(network=NetworkPolicy(mode="loopback")))
    if cluster.standin is not None:
        assert len(cluster.standin.requests()) == calls  # refused before any API call
    assert await provider.list_owned() == []


# ---- readiness ------------------------------------------------------------------------------


async def test_unpullable_image_fails_fast_and_cleans_up(cluster: Cluster) -> None:
    p = _provider(cluster)
    started = time.monotonic()
    with pytest.raises(SandboxError, match="ImagePull") as err:
        await p.create(SandboxSpec(image="corral-test.invalid/missing:1"))
    assert "failed to start" in str(err.value)
    assert time.monotonic() - started < 30  # ImagePullBackOff ends the wait at once
    assert await _pod_names(cluster, p.owner) == set()
    assert await _policy_names(cluster, p.owner) == set()


async def test_unschedulable_pod_times_out_with_the_reason(cluster: Cluster) -> None:
    p = _provider(cluster, start_timeout=2.0)
    with pytest.raises(
        SandboxError, match=r"not ready after 2 s: Unschedulable.*Insufficient memory"
    ):
        await p.create(SandboxSpec(memory_mb=100 * 2**20))  # 100 TiB
    assert await _pod_names(cluster, p.owner) == set()
    assert await _policy_names(cluster, p.owner) == set()


# ---- life -----------------------------------------------------------------------------------


async def test_endpoint_only_under_loopback(provider: KubernetesProvider, cluster: Cluster) -> None:
    sb = await provider.create(SandboxSpec(network=NetworkPolicy(mode="loopback")))
    try:
        pod = await _read_pod(cluster, sb.id)
        assert pod is not None and pod.status is not None and pod.status.pod_ip
        assert await sb.endpoint(8080) == Endpoint(pod.status.pod_ip, 8080)
    finally:
        await sb.close()
    closed = await provider.create(SandboxSpec())
    try:
        with pytest.raises(SandboxError, match="denies all ingress"):
            await closed.endpoint(8080)
    finally:
        await closed.close()


async def test_close_is_idempotent(provider: KubernetesProvider, cluster: Cluster) -> None:
    sb = await provider.create(SandboxSpec())
    assert await sb.is_alive()
    await sb.close()
    await sb.close()
    assert not await sb.is_alive()
    assert await _read_pod(cluster, sb.id) is None
    assert sb.id not in await _policy_names(cluster, provider.owner)
    with pytest.raises(SandboxError, match="closed"):
        await sb.exec(["true"], timeout=5)


@standin_only
async def test_close_finishes_when_the_caller_is_cancelled(
    provider: KubernetesProvider, standin: StandIn
) -> None:
    sb = await provider.create(SandboxSpec())
    pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods/{sb.id}"
    release = standin.hold("DELETE", pod_path)
    closing = asyncio.ensure_future(sb.close())
    seen = await asyncio.to_thread(
        standin.wait_for, lambda s: any(r.path == pod_path for r in s.requests()), 10
    )
    assert seen
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing  # the caller's cancellation is re-raised...
    release.set()
    await sb.close()  # ...while the teardown went on; a second close waits for the same one
    assert standin.pod(sb.id, NAMESPACE) is None and sb.id not in standin.policies(NAMESPACE)
    deletes = [r for r in standin.requests() if r.method == "DELETE" and r.path == pod_path]
    assert len(deletes) == 1


async def test_deleted_pod_is_not_alive(provider: KubernetesProvider, cluster: Cluster) -> None:
    sb = await provider.create(SandboxSpec())
    await _delete_raw(cluster, sb.id)  # behind the sandbox's back
    assert not await sb.is_alive()
    with pytest.raises(SandboxError):
        await sb.exec(["true"], timeout=5)
    await sb.close()  # absent objects are fine


async def test_deadline_ends_the_pod_and_sweep_removes_it(
    provider: KubernetesProvider, cluster: Cluster
) -> None:
    # Long enough for a real cluster to start the Pod before its deadline.
    sb = await provider.create(SandboxSpec(ttl_s=1 if cluster.standin else 10))
    assert await _phase_becomes(cluster, sb.id, "Failed", 60)
    pod = await _read_pod(cluster, sb.id)
    assert pod is not None and pod.status is not None
    assert pod.status.reason == "DeadlineExceeded"
    assert not await sb.is_alive()
    assert sb.id not in await provider.list_owned()
    assert sb.id in await provider.sweep()
    assert await _read_pod(cluster, sb.id) is None
    assert sb.id not in await _policy_names(cluster, provider.owner)


async def test_list_owned(cluster: Cluster) -> None:
    mine, theirs = _provider(cluster), _provider(cluster)
    try:
        a = await mine.create(SandboxSpec())
        b = await mine.create(SandboxSpec())
        c = await theirs.create(SandboxSpec())
        assert await mine.list_owned() == sorted([a.id, b.id])
        assert await theirs.list_owned() == [c.id]
        await a.close()
        assert await mine.list_owned() == [b.id]
    finally:
        await _cleanup(cluster, mine.owner)
        await _cleanup(cluster, theirs.owner)


# The server that crashes: creates a sandbox, says its name, waits to be killed.
CHILD = """
import asyncio, sys
from kubernetes import client, config
from corral.sandboxes.base import SandboxSpec
from corral.sandboxes.kubernetes import KubernetesProvider

target, owner, namespace, image = sys.argv[1:5]
if target.startswith("kubeconfig:"):
    api = config.new_client_from_config(config_file=target[len("kubeconfig:"):])
else:
    api = client.ApiClient(client.Configuration(host=target))

async def main():
    provider = KubernetesProvider(owner, namespace=namespace, image=image, api_client=api)
    sb = await provider.create(SandboxSpec())
    print(sb.id, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_sweep_removes_a_crashed_owners_sandbox(
    cluster: Cluster, provider: KubernetesProvider
) -> None:
    owner = f"crashed-{uuid.uuid4().hex[:8]}"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, cluster.child_target(), owner, NAMESPACE, IMAGE,
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        name = (await child.stdout.readline()).decode().strip()
    finally:
        child.kill()  # SIGKILL: no close, no cleanup
        await child.wait()
    assert name and await _read_pod(cluster, name) is not None
    survivor = await provider.create(SandboxSpec())  # a live owner's: kept
    try:
        gone = await provider.sweep()
        assert name in gone and survivor.id not in gone
        assert await _read_pod(cluster, name) is None
        assert name not in await _policy_names(cluster, owner)
        assert await survivor.is_alive()
    finally:
        await survivor.close()
        await _cleanup(cluster, owner)


async def test_sweep_decides_by_labels(cluster: Cluster, provider: KubernetesProvider) -> None:
    """Expired Pods and orphan policies go; another host's Pods and live owners' orphans stay."""
    core, net = _apis(cluster)
    pid = os.getpid()
    live = {
        OWNER_LABEL: "someone-else",
        HOST_LABEL: socket.gethostname(),
        BOOT_LABEL: boot_id(),
        PID_LABEL: str(pid),
        START_LABEL: str(process_start_time(pid)),
    }
    tag = uuid.uuid4().hex[:6]
    expired = f"corral-expired-{tag}"
    elsewhere = f"corral-elsewhere-{tag}"
    orphan_mine = f"corral-orphan-mine-{tag}"
    orphan_live = f"corral-orphan-live-{tag}"
    pods = {
        expired: live | {SANDBOX_LABEL: expired, EXPIRES_LABEL: f"{time.time() - 10:.3f}"},
        elsewhere: {
            OWNER_LABEL: "someone-else",
            SANDBOX_LABEL: elsewhere,
            HOST_LABEL: "elsewhere",
            PID_LABEL: "1",
        },
    }
    policies = {
        orphan_mine: {OWNER_LABEL: label_value(provider.owner), SANDBOX_LABEL: orphan_mine},
        orphan_live: live | {SANDBOX_LABEL: orphan_live},
    }
    try:
        for name, labels in pods.items():
            await asyncio.to_thread(
                core.create_namespaced_pod,
                NAMESPACE,
                pod_manifest(name, labels, SandboxSpec(), IMAGE),
            )
        for name, labels in policies.items():
            body = k8s.V1NetworkPolicy(
                metadata=k8s.V1ObjectMeta(name=name, labels=labels),
                spec=k8s.V1NetworkPolicySpec(
                    pod_selector=k8s.V1LabelSelector(match_labels={SANDBOX_LABEL: name}),
                    policy_types=["Ingress", "Egress"],
                ),
            )
            await asyncio.to_thread(net.create_namespaced_network_policy, NAMESPACE, body)
        gone = set(await provider.sweep())
        assert {expired, orphan_mine} <= gone
        assert not {elsewhere, orphan_live} & gone
        assert await _read_pod(cluster, expired) is None
        assert await _read_pod(cluster, elsewhere) is not None
        names = await _policy_names(cluster)
        assert orphan_mine not in names and orphan_live in names
    finally:
        for name in (*pods, *policies):
            await _delete_raw(cluster, name)


# ---- configuration and wire helpers ---------------------------------------------------------


async def test_no_configuration_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    provider = KubernetesProvider("nobody")  # nothing is loaded yet
    with pytest.raises(SandboxError, match="no Kubernetes configuration"):
        await provider.list_owned()


def test_label_values_and_exit_status() -> None:
    assert label_value("test-1.a_b") == "test-1.a_b"
    odd = [label_value(t) for t in ("ep 1/2", "ep 1?2", "x" * 80, "-a-")]
    assert all(len(v) <= 63 and v[0].isalnum() and v[-1].isalnum() for v in odd)
    assert len(set(odd)) == len(odd)
    assert exit_code(b'{"metadata":{},"status":"Success"}') == 0
    failure = (
        b'{"status":"Failure","reason":"NonZeroExitCode",'
        b'"details":{"causes":[{"reason":"ExitCode","message":"7"}]}}'
    )
    assert exit_code(failure) == 7
    with pytest.raises(SandboxError, match="not found"):
        exit_code(b'{"status":"Failure","message":"exec: not found","reason":"InternalError"}')


async def test_the_env_server_runs_gridsim_episodes_in_pods(provider: KubernetesProvider) -> None:
    """``corral serve --sandbox kubernetes``: each episode's env in a Pod of its own, the
    runner and bundle uploaded (Pods have no host binds), graded like in-process."""
    from corral.envs.client import EnvClient
    from corral.envs.server import build_app
    from tests.servers import serve

    gridsim = ROOT / "bundles" / "gridsim"
    with serve(build_app(gridsim, sandbox=provider)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=0)
            sim = await env.call_tool("simulate_schedule", {"schedule": [0] * 24})
            assert not sim.observation.is_error and "profit" in sim.observation.text
            out = await env.call_tool("submit_schedule", {"schedule": [0] * 24})
    assert out.done and out.reward == pytest.approx(0.2)
    assert await provider.list_owned() == []


async def test_only_the_env_side_is_uploaded_and_shellcraft_still_solves(
    provider: KubernetesProvider, standin: StandIn
) -> None:
    """Pods have no host binds, so the payload is uploaded file by file (one exec each): what
    the stand-in was asked to write is exactly the env side (shellcraft's ``[env] modules``)
    and corral's runner modules; no verifier, answer, solver, generator or task file enters
    the Pod, and the reference commands still grade 1 (the task's seed stays in the server)."""
    from bundles.shellcraft.solver import solve
    from corral.envs.bundle import load_bundle
    from corral.envs.client import EnvClient
    from corral.envs.hosting import RUNNER_MODULES, UPLOAD_ROOT
    from corral.envs.server import build_app
    from tests.servers import serve

    shellcraft = load_bundle(ROOT / "bundles" / "shellcraft")
    task = shellcraft.task("eval", 0)
    before = len(standin.execs)
    with serve(build_app(shellcraft, sandbox=provider)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=0)
            for command in solve(task.data):
                ran = await env.call_tool("bash", {"command": command})
                assert not ran.observation.is_error, ran.observation.text
            out = await env.call_tool("submit", {})
    assert out.done and out.reward == pytest.approx(1.0)
    # Each upload is an exec whose last argument is the file's path (the backend wraps it).
    written = {
        argv[-1].removeprefix(f"{UPLOAD_ROOT}/")
        for argv, _ in standin.execs[before:]
        if argv[-1].startswith(f"{UPLOAD_ROOT}/") and 'cat > "$1"' in argv[-3]
    }
    env_side = {f"bundle/{rel}" for rel in shellcraft.payload_files()}
    runner = {f"corral/envs/{name}" for name in RUNNER_MODULES}
    assert written - {"corral/__init__.py", "corral/envs/__init__.py"} == env_side | runner
    names = {path.rsplit("/", 1)[-1] for path in written}
    assert not names & {"verifier.py", "answers.py", "solver.py", "generate.py", "files.py"}
    assert not any(path.endswith(".jsonl") for path in written)
