"""A STAND-IN Kubernetes API server for the kubernetes sandbox backend's tests. TEST CODE.

No Kubernetes API server (nor kind, k3s, kwok) can run on the project's machines, so the tests
of :mod:`corral.sandboxes.kubernetes` talk to this one: a real HTTP + WebSocket server (aiohttp)
on 127.0.0.1 that the real ``kubernetes`` client library reaches over the network, exactly as it
would reach a cluster. It implements exactly the API calls the backend makes, with the wire
format of the real API (JSON objects, ``Status`` errors, the exec stream's channel protocol):

========  ===================================================================  ====================
method    path                                                                 client call
========  ===================================================================  ====================
POST      /api/v1/namespaces/{ns}/pods                                         create_namespaced_pod
GET       /api/v1/namespaces/{ns}/pods/{name}                                  read_namespaced_pod
GET       /api/v1/namespaces/{ns}/pods?labelSelector=...                       list_namespaced_pod
DELETE    /api/v1/namespaces/{ns}/pods/{name}                                  delete_namespaced_pod
GET (WS)  /api/v1/namespaces/{ns}/pods/{name}/exec?command=...&stdin=...       stream(connect_get_
                                                                               namespaced_pod_exec)
POST      /apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies           create_namespaced_
                                                                               network_policy
GET       /apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies?label...  list_namespaced_...
DELETE    /apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{name}    delete_namespaced_...
========  ===================================================================  ====================

Anything else is answered ``404`` and recorded in :attr:`StandIn.unexpected` (the tests assert
that it stays empty: the backend uses no call the stand-in does not cover). Label selectors:
``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, comma-joined. The exec stream speaks
``v5.channel.k8s.io`` and ``v4.channel.k8s.io`` (:attr:`StandIn.protocols` picks which it
offers): binary frames whose first byte is the channel (0 stdin, 1 stdout, 2 stderr, 3 status
JSON at the end, ``255 0`` from the client closes stdin under v5), the status being the
kubelet's (``Success``, or ``Failure``/``NonZeroExitCode`` with the code as the ``ExitCode``
cause).

Each Pod is run as a REAL local sandbox, so exec is real: a :class:`~corral.sandboxes.bwrap.
BwrapSandbox` (uid 1000, own pid/net/ipc/uts namespaces, memory limit from the container's
memory limit through the cgroup) whose one long-lived process, an agent (:data:`AGENT`), plays
the container: it starts the container's command (the keeper) as the main process and, for
every exec, runs the command with the stdin/stdout/stderr pipes the stand-in passes it over a
unix socket (``SCM_RIGHTS``). So all execs of a Pod share one pid namespace, one ``/tmp`` and
the working folder, processes outlive the exec that started them (as in a container), and the
container ends when its main process ends. The agent is PID 1 and reaps orphans, as the pause
container does for a Pod with ``shareProcessNamespace``. ``emptyDir`` volumes are host folders
bound in.

Pod status as the kubelet reports it: ``Pending`` with ``PodScheduled=False/Unschedulable`` when
the requests do not fit the node (:attr:`StandIn.node_cpu` / :attr:`node_memory`);
``ErrImagePull`` then ``ImagePullBackOff`` for an image not in :attr:`StandIn.images`;
``CreateContainerConfigError`` for ``runAsNonRoot`` without a non-zero ``runAsUser``; then
``Running`` with the container ready and a pod IP; ``Failed``/``DeadlineExceeded`` once
``activeDeadlineSeconds`` passed; ``Succeeded``/``Failed`` when the main process exits; and
``Failed`` with the container ``OOMKilled`` when the memory cgroup OOM-kills a process (as
cgroup-v2 nodes do with ``memory.oom.group``: the whole container dies). Deleting a Pod also
deletes the NetworkPolicies that name it in an ownerReference (the garbage collector's job).

Not emulated: NetworkPolicy enforcement (policies are stored and recorded, not applied: Pods
have their own network namespace with loopback only, and pod IPs are not routable), resource
versions and watches, ``emptyDir`` size limits, CPU limits, image contents (every Pod runs the
host's ``/usr``), grace periods (deletion is immediate), authentication.

What the tests use: :meth:`StandIn.received` (the objects as the backend sent them),
:meth:`StandIn.requests` (method, path, query, body), :attr:`StandIn.execs` (argv and
negotiated subprotocol of each exec), :meth:`StandIn.pod` / :meth:`StandIn.policies` (what is
stored now), :meth:`StandIn.wait_for` (block until a condition holds) and :meth:`StandIn.hold`
(keep a request in flight until released).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import math
import os
import re
import shutil
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from corral.sandboxes.base import Bind, SandboxProcess, SandboxSpec
from corral.sandboxes.bwrap import BwrapProvider, BwrapSandbox
from corral.sandboxes.cgroups import read_counter, remove_cgroup
from corral.sandboxes.image import DEFAULT_TAG

V5 = "v5.channel.k8s.io"
V4 = "v4.channel.k8s.io"
STDIN, STDOUT, STDERR, ERROR, CLOSE = 0, 1, 2, 3, 255
CONTROL_DIR = "/run/k8s-standin"  # where the agent's socket is, inside the Pod

# The container's stand-in, run with the host's python3 inside the Pod's bwrap sandbox:
# argv: socket path, JSON of the container's command. Writes JSON events on stdout.
AGENT = r"""
import array, json, os, socket, sys, threading

path, main = sys.argv[1], json.loads(sys.argv[2])
lock = threading.Lock()
waiting = {}  # pid -> [event, exit code]


def code(status):
    rc = os.waitstatus_to_exitcode(status)
    return 128 - rc if rc < 0 else rc


def event(**kw):
    print(json.dumps(kw), flush=True)


def start(argv, fds):
    # Registered under the lock the reaper takes: its exit cannot be reaped unseen.
    with lock:
        dup = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(fds)]
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=dup)
        slot = waiting[pid] = [threading.Event(), None]
    return slot


def receive(conn):
    # The pipes arrive close-on-exec (socket.recv_fds drops its flags on Python 3.11): a
    # command spawned meanwhile by another thread must not inherit them, it would hold this
    # exec's output open. Only this exec's command gets them, as its 0, 1 and 2.
    fds = array.array("i")
    room = socket.CMSG_SPACE(3 * fds.itemsize)
    msg, anc, _, _ = conn.recvmsg(1 << 20, room, socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def reap():
    # PID 1 of the Pod: reap everything (orphans too, as the pause container does).
    while True:
        pid, status = os.wait()
        with lock:
            slot = waiting.pop(pid, None)
        if slot is not None:
            slot[1] = code(status)
            slot[0].set()


def serve(conn):
    with conn:
        msg, fds = receive(conn)
        try:
            slot = start(json.loads(msg)["argv"], fds)
            reply = None
        except OSError as e:
            reply = {"error": str(e)}
        finally:
            for fd in fds:
                os.close(fd)
        if reply is None:
            slot[0].wait()
            reply = {"exit": slot[1]}
        try:
            conn.sendall(json.dumps(reply).encode())
        except OSError:
            pass


def accept(srv):
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(64)
null = os.open(os.devnull, os.O_RDWR)
try:
    keeper = start(main, [null, null, 2])
except OSError as e:
    event(event="failed", message=str(e))
    sys.exit(128)
threading.Thread(target=reap, daemon=True).start()
threading.Thread(target=accept, args=(srv,), daemon=True).start()
event(event="started")
keeper[0].wait()
event(event="exited", code=keeper[1])
"""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity (``500m``, ``2``, ``64Mi``, ``1G``) in base units."""
    s = str(text)
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    units |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", s)
    if not match or match.group(2) not in units | {"": 1}:
        raise ValueError(f"not a quantity: {s!r}")
    return float(match.group(1)) * (units.get(match.group(2), 1))


def selector(text: str) -> Callable[[dict[str, str]], bool]:
    """A label selector (equality-based terms, comma-joined) as a predicate on labels."""
    terms: list[tuple[str, str, str]] = []  # (operator, key, value)
    for term in (t.strip() for t in text.split(",")):
        if "!=" in term:
            k, v = term.split("!=", 1)
            terms.append(("!=", k.strip(), v.strip()))
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            terms.append(("=", k.strip(), v.strip()))
        elif term.startswith("!"):
            terms.append(("!", term[1:].strip(), ""))
        elif term:
            terms.append(("", term, ""))

    def holds(op: str, key: str, value: str, labels: dict[str, str]) -> bool:
        if op == "!=":
            return labels.get(key) != value
        if op == "=":
            return labels.get(key) == value
        return (key in labels) == (op == "")

    return lambda labels: all(holds(*t, labels) for t in terms)


def status_body(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    """A ``Status`` object as the API server answers errors with."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }


def exec_status(argv: list[str], code: int | None, error: str | None) -> dict[str, Any]:
    """The exec stream's last message (channel 3), as the kubelet writes it."""
    if error is not None:
        return {
            "metadata": {},
            "status": "Failure",
            "message": error,
            "reason": "InternalError",
            "details": {"causes": [{"message": error}]},
            "code": 500,
        }
    if code == 0:
        return {"metadata": {}, "status": "Success"}
    return {
        "metadata": {},
        "status": "Failure",
        "message": f"command terminated with non-zero exit code: error executing command "
        f"{argv}: exit code {code}",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
    }


@dataclass(frozen=True)
class Request:
    """One request the stand-in answered."""

    method: str
    path: str
    query: tuple[tuple[str, str], ...]
    body: Any


@dataclass
class _Pod:
    """One Pod: the stored object and what runs it."""

    obj: dict[str, Any]
    box: BwrapSandbox | None = None
    agent: SandboxProcess | None = None
    folder: Path | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    stopped: bool = False

    @property
    def container(self) -> dict[str, Any]:
        return dict(self.obj["spec"]["containers"][0])

    @property
    def phase(self) -> str:
        return str(self.obj["status"].get("phase"))


class StandIn:
    """The stand-in API server; runs on a thread of its own (own event loop), so that tests on
    any event loop, and the backend's worker threads, reach it like a remote server.

    ``state_dir``: where Pods' folders go. ``images``: the images that "pull"; any other name
    fails with ``ErrImagePull``/``ImagePullBackOff``. ``node_cpu`` (cores) / ``node_memory``
    (bytes): the one node's allocatable resources."""

    def __init__(
        self,
        state_dir: Path,
        *,
        images: Iterable[str] = (DEFAULT_TAG,),
        node_cpu: float = 64.0,
        node_memory: float = 256 * 2**30,
    ) -> None:
        self.state_dir = state_dir
        self.images = set(images)
        self.node_cpu = node_cpu
        self.node_memory = node_memory
        self.protocols: tuple[str, ...] = (V5, V4)
        self.unexpected: list[str] = []
        self.execs: list[tuple[list[str], str | None]] = []
        self.url = ""
        self._requests: list[Request] = []
        self._received: dict[tuple[str, str], dict[str, Any]] = {}
        self._pods: dict[tuple[str, str], _Pod] = {}
        self._policies: dict[tuple[str, str], dict[str, Any]] = {}
        self._changed = threading.Condition()
        self._ips = itertools.count(2)
        self._bwrap = BwrapProvider("k8s-standin", state_dir / "bwrap")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._kills: set[asyncio.Task[None]] = set()
        self._started: list[_Pod] = []  # every Pod that got a sandbox (for stop's last resort)
        self._holds: dict[tuple[str, str], threading.Event] = {}

    # -- life ---------------------------------------------------------------------------------

    def start(self) -> str:
        """Start serving on 127.0.0.1 (a free port); return the base URL."""
        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            loop.run_until_complete(self._serve())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=main, name="k8s-standin", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the stand-in API server did not start")
        return self.url

    def stop(self) -> None:
        """Kill every Pod and stop serving. Whatever the server's own shutdown did not get to
        (it hung, or its thread is gone) is killed here through the Pods' cgroups."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(60)
        for pod in self._started:
            if pod.box is not None:
                for cgroup in pod.box.cgroups.values():
                    remove_cgroup(cgroup)  # kills what is left, then removes it
            if pod.folder is not None:
                shutil.rmtree(pod.folder, ignore_errors=True)

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        # Shutdown waits this long for open exec streams (their Pods are gone by then).
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def _shutdown(self) -> None:
        for pod in list(self._pods.values()):
            await self._stop_pod(pod)
        self._pods.clear()
        if self._kills:
            await asyncio.gather(*self._kills, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- what tests inspect -------------------------------------------------------------------

    def requests(self) -> list[Request]:
        with self._changed:
            return list(self._requests)

    def received(self, kind: str, name: str) -> dict[str, Any]:
        """The ``pods`` / ``networkpolicies`` object named ``name`` as the client POSTed it."""
        with self._changed:
            return copy.deepcopy(self._received[(kind, name)])

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        """The stored Pod (with the status the stand-in gives it), or ``None``."""
        with self._changed:
            pod = self._pods.get((namespace, name))
            return copy.deepcopy(pod.obj) if pod else None

    def policies(self, namespace: str = "default") -> list[str]:
        with self._changed:
            return sorted(n for ns, n in self._policies if ns == namespace)

    def wait_for(self, predicate: Callable[[StandIn], bool], timeout: float) -> bool:
        """Block until ``predicate(self)`` holds (re-checked at every change); whether it did
        within ``timeout`` seconds. Call from a thread (e.g. ``asyncio.to_thread``)."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)

    def hold(self, method: str, path: str) -> threading.Event:
        """Hold the next ``method path`` request (recorded, not answered) until the returned
        event is set: a test can act while a call is in flight."""
        release = threading.Event()
        with self._changed:
            self._holds[(method, path)] = release
        return release

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # -- HTTP ---------------------------------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body: Any = None
        if request.can_read_body:
            raw = await request.read()
            with contextlib.suppress(ValueError):
                body = json.loads(raw) if raw else None
        with self._changed:
            self._requests.append(
                Request(request.method, request.path, tuple(request.query.items()), body)
            )
            self._changed.notify_all()
            held = self._holds.pop((request.method, request.path), None)
        if held is not None:
            await asyncio.to_thread(held.wait, 60)
        parts = request.path.strip("/").split("/")
        method = request.method
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) >= 5 and parts[4] == "pods":
            ns, rest = parts[3], parts[5:]
            if method == "POST" and not rest:
                return await self._create_pod(ns, body)
            if method == "GET" and not rest:
                return self._list("pods", ns, request.query.get("labelSelector", ""))
            if method == "GET" and len(rest) == 1:
                return self._read_pod(ns, rest[0])
            if method == "DELETE" and len(rest) == 1:
                return await self._delete_pod(ns, rest[0])
            if method == "GET" and len(rest) == 2 and rest[1] == "exec":
                return await self._exec(ns, rest[0], request)
        np_prefix = ["apis", "networking.k8s.io", "v1", "namespaces"]
        if parts[:4] == np_prefix and len(parts) >= 6 and parts[5] == "networkpolicies":
            ns, rest = parts[4], parts[6:]
            if method == "POST" and not rest:
                return self._create_policy(ns, body)
            if method == "GET" and not rest:
                return self._list("networkpolicies", ns, request.query.get("labelSelector", ""))
            if method == "DELETE" and len(rest) == 1:
                return self._delete_policy(ns, rest[0])
        self.unexpected.append(f"{method} {request.path_qs}")
        return _json(404, status_body(404, "NotFound", "the stand-in does not serve this call"))

    def _list(self, kind: str, ns: str, label_selector: str) -> web.Response:
        match = selector(label_selector)
        with self._changed:
            if kind == "pods":
                objs = [p.obj for (n, _), p in self._pods.items() if n == ns]
                list_kind, api = "PodList", "v1"
            else:
                objs = [o for (n, _), o in self._policies.items() if n == ns]
                list_kind, api = "NetworkPolicyList", "networking.k8s.io/v1"
            items = [copy.deepcopy(o) for o in objs if match(o["metadata"].get("labels") or {})]
        return _json(
            200,
            {
                "apiVersion": api,
                "kind": list_kind,
                "metadata": {"resourceVersion": "1"},
                "items": items,
            },
        )

    # -- pods ---------------------------------------------------------------------------------

    async def _create_pod(self, ns: str, body: Any) -> web.Response:
        name = (body or {}).get("metadata", {}).get("name")
        if not name or not body.get("spec", {}).get("containers"):
            return _json(
                422, status_body(422, "Invalid", "metadata.name and spec.containers are required")
            )
        if (ns, name) in self._pods:
            return _json(
                409,
                status_body(
                    409, "AlreadyExists", f'pods "{name}" already exists', name=name, kind="pods"
                ),
            )
        obj = copy.deepcopy(body)
        obj["metadata"] |= {
            "namespace": ns,
            "uid": str(uuid.uuid4()),
            "creationTimestamp": _now(),
            "resourceVersion": "1",
        }
        obj["status"] = {"phase": "Pending", "conditions": []}
        pod = _Pod(obj)
        with self._changed:
            self._received[("pods", name)] = copy.deepcopy(body)
            self._pods[(ns, name)] = pod
            self._changed.notify_all()
        pod.tasks.append(asyncio.ensure_future(self._run_pod(pod)))
        return _json(201, copy.deepcopy(obj))

    def _read_pod(self, ns: str, name: str) -> web.Response:
        with self._changed:
            pod = self._pods.get((ns, name))
            if pod is None:
                return _json(
                    404,
                    status_body(
                        404, "NotFound", f'pods "{name}" not found', name=name, kind="pods"
                    ),
                )
            return _json(200, copy.deepcopy(pod.obj))

    async def _delete_pod(self, ns: str, name: str) -> web.Response:
        with self._changed:
            pod = self._pods.pop((ns, name), None)
            if pod is None:
                return _json(
                    404,
                    status_body(
                        404, "NotFound", f'pods "{name}" not found', name=name, kind="pods"
                    ),
                )
            # The garbage collector: policies owned by this Pod go with it.
            uid = pod.obj["metadata"]["uid"]
            for key, policy in list(self._policies.items()):
                refs = policy["metadata"].get("ownerReferences") or []
                if key[0] == ns and any(r.get("uid") == uid for r in refs):
                    del self._policies[key]
            pod.obj["metadata"]["deletionTimestamp"] = _now()
            self._changed.notify_all()
        kill = asyncio.ensure_future(self._stop_pod(pod))
        self._kills.add(kill)
        kill.add_done_callback(self._kills.discard)
        return _json(200, copy.deepcopy(pod.obj))

    def _set(self, pod: _Pod, **status: Any) -> None:
        with self._changed:
            pod.obj["status"] |= status
            self._changed.notify_all()

    def _container_status(
        self, pod: _Pod, state: dict[str, Any], *, ready: bool = False
    ) -> dict[str, Any]:
        c = pod.container
        return {
            "name": c["name"],
            "image": c.get("image", ""),
            "imageID": "",
            "ready": ready,
            "started": "running" in state,
            "restartCount": 0,
            "state": state,
        }

    def _set_container(
        self, pod: _Pod, state: str, *, ready: bool = False, phase: str | None = None, **fields: Any
    ) -> None:
        """Put the container in ``state`` (``waiting``/``running``/``terminated``) with
        ``fields`` (reason, message, exitCode...), and the Pod in ``phase`` when given."""
        status: dict[str, Any] = {
            "containerStatuses": [self._container_status(pod, {state: fields}, ready=ready)]
        }
        if phase is not None:
            status["phase"] = phase
        self._set(pod, **status)

    async def _run_pod(self, pod: _Pod) -> None:
        """Schedule, "pull", start the Pod's sandbox and agent, then follow its main process."""
        c = pod.container
        spec = pod.obj["spec"]
        why = self._unschedulable(pod)
        if why:
            self._set(pod, conditions=[_condition("PodScheduled", "False", "Unschedulable", why)])
            return
        self._set(pod, conditions=[_condition("PodScheduled", "True")], startTime=_now())
        if deadline := spec.get("activeDeadlineSeconds"):
            pod.tasks.append(asyncio.ensure_future(self._deadline(pod, float(deadline))))
        image = c.get("image")
        if image not in self.images:
            msg = f'failed to pull image "{image}": not found'
            self._set_container(pod, "waiting", reason="ErrImagePull", message=msg)
            await asyncio.sleep(0.2)  # the kubelet's back-off, shortened
            msg = f'Back-off pulling image "{image}"'
            self._set_container(pod, "waiting", reason="ImagePullBackOff", message=msg)
            return
        security = spec.get("securityContext", {}) | c.get("securityContext", {})
        if security.get("runAsNonRoot") and not security.get("runAsUser"):
            msg = "container has runAsNonRoot and image will run as root"
            self._set_container(pod, "waiting", reason="CreateContainerConfigError", message=msg)
            return
        try:
            await self._start_container(pod)
        except Exception as e:
            msg = f"stand-in could not start the container: {e}"
            self._set_container(
                pod, "terminated", phase="Failed", reason="StartError", message=msg, exitCode=128
            )
            await self._stop_pod(pod)
            return
        assert pod.agent is not None
        while line := await pod.agent.readline():
            event = json.loads(line)
            if event["event"] == "exited":
                code = int(event["code"])
                self._set_container(
                    pod,
                    "terminated",
                    phase="Succeeded" if code == 0 else "Failed",
                    reason="Completed" if code == 0 else "Error",
                    exitCode=code,
                )
                break
        await self._stop_pod(pod)

    def _unschedulable(self, pod: _Pod) -> str | None:
        """The scheduler's message when the Pod's requests do not fit next to the others."""

        def requests(p: _Pod) -> tuple[float, float]:
            r = (p.container.get("resources") or {}).get("requests") or {}
            return quantity(r.get("cpu", 0)), quantity(r.get("memory", 0))

        with self._changed:
            others = [
                p
                for p in self._pods.values()
                if p is not pod
                and p.obj["status"].get("startTime")
                and p.phase not in ("Failed", "Succeeded")
            ]
        cpu, mem = requests(pod)
        used_cpu = sum(requests(p)[0] for p in others)
        used_mem = sum(requests(p)[1] for p in others)
        short = [
            n
            for n, over in (
                ("cpu", used_cpu + cpu > self.node_cpu),
                ("memory", used_mem + mem > self.node_memory),
            )
            if over
        ]
        if not short:
            return None
        lacks = ", ".join(f"1 Insufficient {s}" for s in short)
        return (
            f"0/1 nodes are available: {lacks}. preemption: 0/1 nodes are available: "
            "1 No preemption victims found for incoming pod."
        )

    async def _start_container(self, pod: _Pod) -> None:
        c = pod.container
        limits = (c.get("resources") or {}).get("limits") or {}
        workdir = c.get("workingDir") or "/"
        pod.folder = self.state_dir / "pods" / pod.obj["metadata"]["uid"]
        control = pod.folder / "control"
        control.mkdir(parents=True)
        volumes = {v["name"]: v for v in pod.obj["spec"].get("volumes") or []}
        binds = [Bind(source=control, target=CONTROL_DIR, writable=True)]
        for mount in c.get("volumeMounts") or []:
            if "emptyDir" not in volumes.get(mount["name"], {}):
                raise ValueError(f"volume {mount['name']!r}: the stand-in has emptyDir only")
            if mount["mountPath"] == workdir:
                continue  # the bwrap sandbox's own folder is the working folder
            host = pod.folder / "volumes" / mount["name"]
            host.mkdir(parents=True)
            host.chmod(0o777)  # emptyDir's mode
            binds.append(Bind(source=host, target=mount["mountPath"], writable=True))
        memory = limits.get("memory")
        box = await self._bwrap.create(
            SandboxSpec(
                workdir=workdir,
                memory_mb=math.ceil(quantity(memory) / 2**20) if memory else None,
                binds=tuple(binds),
                ttl_s=None,
            )
        )
        pod.box = box
        self._started.append(pod)
        env = {e["name"]: e.get("value", "") for e in c.get("env") or []}
        main = (c.get("command") or []) + (c.get("args") or [])
        sock = f"{CONTROL_DIR}/agent.sock"
        pod.agent = await box.spawn(
            ["python3", "-c", AGENT, sock, json.dumps(main)], env=env, cwd=workdir
        )
        first = json.loads(
            await pod.agent.readline() or b'{"event": "failed", "message": "agent died"}'
        )
        if first["event"] != "started":
            raise RuntimeError(f"{first.get('message')} {pod.agent.stderr_tail()}")
        ip = f"10.244.0.{next(self._ips) % 250 + 2}"
        self._set(
            pod,
            podIP=ip,
            podIPs=[{"ip": ip}],
            hostIP="10.0.0.1",
            conditions=[
                _condition("PodScheduled", "True"),
                _condition("Ready", "True"),
                _condition("ContainersReady", "True"),
            ],
        )
        # Running and ready in one change: a reader never sees one without the other.
        self._set_container(pod, "running", ready=True, phase="Running", startedAt=_now())

    async def _deadline(self, pod: _Pod, seconds: float) -> None:
        await asyncio.sleep(seconds)
        if pod.phase in ("Failed", "Succeeded"):
            return
        message = "Pod was active on the node longer than the specified deadline"
        self._set(pod, reason="DeadlineExceeded", message=message)
        self._set_container(pod, "terminated", phase="Failed", reason="Error", exitCode=137)
        await self._stop_pod(pod)

    def _oom_kills(self, pod: _Pod) -> int:
        """OOM kills in the Pod's memory cgroup so far (0 where limits are not enforced)."""
        memory = pod.box.cgroups.get("memory") if pod.box is not None else None
        return read_counter(memory / "memory.oom_control", "oom_kill") if memory else 0

    async def _oom(self, pod: _Pod) -> None:
        """cgroup v2's ``memory.oom.group``: one OOM kill ends the whole container."""
        self._set_container(pod, "terminated", phase="Failed", reason="OOMKilled", exitCode=137)
        await self._stop_pod(pod)

    async def _stop_pod(self, pod: _Pod) -> None:
        """Kill what runs for ``pod`` and remove its folders. Idempotent."""
        if pod.stopped:
            return
        pod.stopped = True
        current = asyncio.current_task()
        for task in pod.tasks:
            if task is not current:
                task.cancel()
        if pod.agent is not None:
            await pod.agent.kill()
        if pod.box is not None:
            await pod.box.close()
        if pod.folder is not None:
            await asyncio.to_thread(shutil.rmtree, pod.folder, True)
        self._notify()

    # -- network policies ---------------------------------------------------------------------

    def _create_policy(self, ns: str, body: Any) -> web.Response:
        name = (body or {}).get("metadata", {}).get("name")
        if not name or "podSelector" not in body.get("spec", {}):
            return _json(
                422, status_body(422, "Invalid", "metadata.name and spec.podSelector are required")
            )
        with self._changed:
            if (ns, name) in self._policies:
                return _json(
                    409,
                    status_body(
                        409,
                        "AlreadyExists",
                        f'networkpolicies.networking.k8s.io "{name}" already exists',
                    ),
                )
            obj = copy.deepcopy(body)
            obj["metadata"] |= {
                "namespace": ns,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": _now(),
            }
            self._received[("networkpolicies", name)] = copy.deepcopy(body)
            self._policies[(ns, name)] = obj
            self._changed.notify_all()
        return _json(201, copy.deepcopy(obj))

    def _delete_policy(self, ns: str, name: str) -> web.Response:
        with self._changed:
            obj = self._policies.pop((ns, name), None)
            self._changed.notify_all()
        if obj is None:
            msg = f'networkpolicies.networking.k8s.io "{name}" not found'
            return _json(404, status_body(404, "NotFound", msg, name=name, kind="networkpolicies"))
        details = {"name": name, "group": "networking.k8s.io", "kind": "networkpolicies"}
        details["uid"] = obj["metadata"]["uid"]
        return _json(
            200,
            {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
             "details": details},
        )  # fmt: skip

    # -- exec ---------------------------------------------------------------------------------

    async def _exec(self, ns: str, name: str, request: web.Request) -> web.StreamResponse:
        pod = self._pods.get((ns, name))
        if pod is None:
            return _json(404, status_body(404, "NotFound", f'pods "{name}" not found'))
        if pod.phase != "Running" or pod.stopped:
            msg = f"cannot exec into a container in a completed pod; current phase is {pod.phase}"
            return _json(400, status_body(400, "BadRequest", msg))
        argv = request.query.getall("command", [])
        want_stdin = request.query.get("stdin") == "true"
        ws = web.WebSocketResponse(protocols=self.protocols, max_msg_size=0, compress=False)
        await ws.prepare(request)
        with self._changed:
            self.execs.append((list(argv), ws.ws_protocol))
            self._changed.notify_all()
        if ws.ws_protocol is None:
            await ws.close(message=b"no supported channel protocol")
            return ws
        await _Exec(self, pod, ws, argv, want_stdin).run()
        return ws


class _Exec:
    """One exec stream: pipes to the agent (``SCM_RIGHTS``), frames to and from the client."""

    def __init__(
        self, standin: StandIn, pod: _Pod, ws: web.WebSocketResponse, argv: list[str], stdin: bool
    ):
        self.standin = standin
        self.pod = pod
        self.ws = ws
        self.argv = argv
        self.want_stdin = stdin
        self.v5 = ws.ws_protocol == V5

    async def run(self) -> None:
        assert self.pod.folder is not None
        loop = asyncio.get_running_loop()
        in_r, in_w = os.pipe() if self.want_stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.setblocking(False)
        try:
            await loop.sock_connect(conn, str(self.pod.folder / "control" / "agent.sock"))
            socket.send_fds(conn, [json.dumps({"argv": self.argv}).encode()], [in_r, out_w, err_w])
        except OSError as e:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                if fd >= 0:
                    os.close(fd)
            conn.close()
            status = exec_status(self.argv, None, f"cannot reach the container: {e}")
            await self._send(ERROR, json.dumps(status).encode())
            await self.ws.close()
            return
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        stdin = await _pipe_writer(in_w) if in_w >= 0 else None
        relays = [
            asyncio.ensure_future(self._relay(await _pipe_reader(out_r), STDOUT)),
            asyncio.ensure_future(self._relay(await _pipe_reader(err_r), STDERR)),
        ]
        finished = asyncio.ensure_future(self._finish(conn, relays))
        client = asyncio.ensure_future(self._from_client(stdin))
        try:
            await asyncio.wait({finished, client}, return_when=asyncio.FIRST_COMPLETED)
            if finished.done():
                await self._send(ERROR, json.dumps(finished.result()).encode())
                await self.ws.close()
        finally:
            for task in (finished, client, *relays):
                task.cancel()
            await asyncio.gather(finished, client, *relays, return_exceptions=True)
            if stdin is not None:
                stdin.close()
            conn.close()

    async def _finish(
        self, conn: socket.socket, relays: Sequence[asyncio.Future[None]]
    ) -> dict[str, Any]:
        """The command's status, once it ended and its output is all relayed."""
        loop = asyncio.get_running_loop()
        reply = b""
        while chunk := await loop.sock_recv(conn, 65536):
            reply += chunk
        await asyncio.gather(*relays)
        try:
            answer = json.loads(reply)
        except ValueError:
            answer = {"error": "the container went away"}
        if answer.get("exit") is not None and self.standin._oom_kills(self.pod) > 0:
            await self.standin._oom(self.pod)
        return exec_status(self.argv, answer.get("exit"), answer.get("error"))

    async def _relay(self, reader: asyncio.StreamReader, channel: int) -> None:
        while chunk := await reader.read(65536):
            await self._send(channel, chunk)

    async def _send(self, channel: int, data: bytes) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            if not self.ws.closed:
                await self.ws.send_bytes(bytes([channel]) + data)

    async def _from_client(self, stdin: asyncio.StreamWriter | None) -> None:
        """Client frames until the client goes away: stdin data, and stdin's close (v5)."""
        async for msg in self.ws:
            if msg.type != WSMsgType.BINARY or not msg.data:
                continue
            channel, payload = msg.data[0], msg.data[1:]
            if channel == STDIN and stdin is not None and not stdin.is_closing():
                stdin.write(payload)
                with contextlib.suppress(ConnectionError):
                    await stdin.drain()
            elif (
                channel == CLOSE and self.v5 and payload[:1] == bytes([STDIN]) and stdin is not None
            ):
                stdin.close()


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**20)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
    )
    return reader


async def _pipe_writer(fd: int) -> asyncio.StreamWriter:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_write_pipe(
        lambda: asyncio.streams.FlowControlMixin(), os.fdopen(fd, "wb", 0)
    )
    return asyncio.StreamWriter(transport, protocol, None, loop)


def _condition(
    kind: str, status: str, reason: str | None = None, message: str | None = None
) -> dict[str, Any]:
    cond: dict[str, Any] = {"type": kind, "status": status, "lastTransitionTime": _now()}
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


def _json(status: int, body: Any) -> web.Response:
    return web.json_response(body, status=status)
