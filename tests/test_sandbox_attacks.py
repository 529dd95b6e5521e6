"""Model actions against the env's runner, on every backend that runs here (local, bwrap,
docker with the test daemon): a real :class:`~corral.envs.hosting.SandboxHost` for shellcraft,
an episode whose bash commands attack (tests/sandbox_attacks.py), and the verifier's own
grading afterwards.

The attack program reports each attempt; the tests assert that every one that the backend
documents as stopped was refused (the report is the proof that it ran), that no needle (the
task's canary id and seed in the runner's memory, a secret in the server's environment, the
env server's token) shows up anywhere in what the model saw, that the runner still answers,
and that the episode grades: idle 0, the reference commands 1. The kubernetes and e2b backends
cannot run here (no cluster, no E2B account): their attacks run through STAND-INS (the real
``kubernetes`` client and ``e2b`` SDK talking HTTP to stand-in API servers on 127.0.0.1, test
code), and since their jails are empty (docs/sandboxes.md says why) those tests also assert
that what the docs say gets through there (signals, writes to the uploaded code) does.

The unjailed local backend as root is the control: there the model's shell is root, reads the
runner's memory and finds the seed: the original cheat, so the attack is known to detect it.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bundles.shellcraft.solver import solve as reference
from corral.envs.bundle import Bundle, load_bundle
from corral.envs.hosting import UPLOAD_ROOT, EnvHandle, SandboxHost, env_host
from corral.envs.server import build_app
from corral.sandboxes.base import SandboxProvider, SandboxSpec
from corral.sandboxes.bwrap import BwrapProvider
from corral.sandboxes.image import DEFAULT_TAG
from corral.sandboxes.local import LocalProvider
from corral.serving import serve_in_thread
from tests.conftest import ROOT, SANDBOX_IMAGE
from tests.sandbox_attacks import attack_command

SHELLCRAFT = ROOT / "bundles" / "shellcraft"
SECRET_VARIABLE = "CORRAL_ATTACK_TEST_SECRET"

# What each backend keeps from the model (docs/sandboxes.md, the threat model): the attacks
# that must be refused there. The rest are reported as the documented behaviour.
ALWAYS = (
    "mem_read",
    "runner_environ",
    "fd_open",
    "own_fds",
    "own_stdin",
    "environ",
    "import_verifier",
    "runner_cwd",
    "ptrace_attach",
    "mem_write",
)
SIGNALS = ("signal_0", "signal_stop", "signal_kill", "pidfd_signal")
CODE = ("code_list", "code_write", "grading_code")
REFUSED = {
    "local-root": (*ALWAYS, *SIGNALS, "code_list", "code_write", "maps", "fd_list"),
    "bwrap": (*ALWAYS, *SIGNALS, *CODE, "server_port", "maps"),
    "docker": (*ALWAYS, *SIGNALS, *CODE, "server_port", "maps", "fd_list"),
}


@pytest.fixture(scope="module")
def bundle() -> Bundle:
    return load_bundle(SHELLCRAFT)


@pytest.fixture(scope="module")
def server_port(bundle: Bundle) -> Iterator[tuple[int, str]]:
    """A real env server on 127.0.0.1 (its own local backend), and its token: the port the
    model tries to reach, the token it must not find."""
    token = secrets.token_hex(16)
    app = build_app(bundle, token=token, sandbox=LocalProvider("attack-target"))
    with serve_in_thread(app) as url:
        yield int(url.rsplit(":", 1)[1].split("/")[0]), token


@pytest.fixture
def server_secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A secret in the server's environment: set in this process (whose children must not
    get it), and in the initial environment of a process of the server's user (``cat`` on a
    pipe, alive until the test ends), since ``/proc/<pid>/environ`` shows only that one."""
    value = secrets.token_hex(16)
    monkeypatch.setenv(SECRET_VARIABLE, value)
    holder = subprocess.Popen(["cat"], stdin=subprocess.PIPE, env={SECRET_VARIABLE: value})
    try:
        yield value
    finally:
        holder.kill()
        holder.wait()


async def _open(bundle: Bundle, provider: SandboxProvider) -> SandboxHost:
    host = env_host(bundle, provider)
    assert isinstance(host, SandboxHost)
    await host.open()
    return host


async def _bash(env: EnvHandle, command: str) -> str:
    outcome = await env.call_tool("bash", {"command": command})
    return outcome.content


@dataclasses.dataclass
class Played:
    attacks: dict[str, str]
    seen: str  # everything the model's tools answered
    scores: dict[str, float]


async def _play(
    bundle: Bundle,
    provider: SandboxProvider,
    needles: list[bytes],
    port: int,
    *,
    solve: bool,
    gentle: bool = False,
    host: SandboxHost | None = None,
) -> Played:
    """One episode: the attack, a check that the runner answers, the reference commands (when
    ``solve``), submit, and the verifier's grade of the env's final state. ``host``: the
    episode's host on ``provider`` (default: the server's own, :func:`env_host`)."""
    if host is None:
        host = await _open(bundle, provider)
    else:
        await host.open()
    task = dataclasses.replace(bundle.task("train", 0), id=needles[0].decode())
    env = await host.start()
    try:
        await env.reset(task)
        roots = [host.code_root]
        encoded = [base64.b64encode(n).decode() for n in needles]
        command = attack_command(encoded, port, roots, gentle=gentle)
        report = await _bash(env, command)
        seen = report
        line = next((x for x in report.splitlines() if x.startswith("ATTACKS ")), None)
        assert line is not None, f"the attack did not run to its end: {report[-3000:]}"
        attacks = json.loads(line.removeprefix("ATTACKS "))
        alive = await _bash(env, "echo still-here")  # the runner survived every attack
        assert "still-here" in alive, alive
        for step in reference(task.data) if solve else []:
            seen += await _bash(env, step)
        await env.call_tool("submit", {})
        scores = bundle.grade(task, await env.state())
    finally:
        await env.close()
        await host.aclose()
    assert await provider.list_owned() == []
    return Played(attacks, seen, scores)


def _needles(bundle: Bundle, secret: str, token: str) -> list[bytes]:
    """The canary task id (first), the task's seed as the runner got it, the two secrets."""
    seed = bundle.task("train", 0).data["seed"]
    canary = f"canary-{secrets.token_hex(12)}"
    return [canary.encode(), f'"seed":{seed}'.encode(), secret.encode(), token.encode()]


def _check(played: Played, backend: str, needles: list[bytes]) -> None:
    attacks = played.attacks
    print(backend, json.dumps(attacks, indent=1))  # the report, for -s
    assert attacks["runner_found"].startswith("GOT"), attacks  # else every attack hit nothing
    got = {k: v for k, v in attacks.items() if k in REFUSED[backend] and v.startswith("GOT")}
    assert got == {}, f"{backend}: attacks that got through: {got}\nall: {attacks}"
    for needle in needles[2:]:  # the server's secrets, anywhere in what the model was shown
        assert needle.decode() not in played.seen


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _kept_from_the_model_and_graded(
    bundle: Bundle, provider: Any, backend: str, port: int, secret: str, token: str
) -> None:
    """Attack ``provider``'s sandboxes twice: with the reference commands after the attacks
    (graded correct 1) and idle (graded 0); every attack the backend keeps must fail both times."""
    needles = _needles(bundle, secret, token)
    played = _run(_play(bundle, provider, needles, port, solve=True))
    _check(played, backend, needles)
    assert played.scores["correct"] == 1.0, played.scores
    idle = _run(_play(bundle, provider, needles, port, solve=False))
    _check(idle, backend, needles)
    assert idle.scores["correct"] == 0.0 and idle.scores["partial"] == 0.0, idle.scores


@pytest.mark.skipif(os.geteuid() != 0, reason="the jailed local backend needs root")
def test_local_as_root_jails_the_model_as_nobody(
    bundle: Bundle, server_port: tuple[int, str], server_secret: str
) -> None:
    """As root, local runs model commands as nobody: the runner is out of reach, but the host's
    files (the bundle's grading code in its folder) and network are not: documented."""
    port, token = server_port
    needles = _needles(bundle, server_secret, token)
    provider = LocalProvider(f"attacks-local-{secrets.token_hex(4)}")
    assert provider.model_jail(SandboxSpec())[0].endswith("setpriv")
    played = _run(_play(bundle, provider, needles, port, solve=True))
    _check(played, "local-root", needles)
    assert played.attacks["grading_code"].startswith("GOT"), played.attacks  # not kept: local
    assert played.attacks["server_port"].startswith("GOT"), played.attacks  # the host's network
    assert played.scores["correct"] == 1.0, played.scores


@pytest.mark.skipif(os.geteuid() != 0, reason="the control reads memory as root")
def test_unjailed_local_as_root_is_the_original_cheat(
    bundle: Bundle, server_port: tuple[int, str], server_secret: str
) -> None:
    """The control: local with no jail (``model_uid=None``) as root. The model's shell is root
    (``CAP_SYS_PTRACE``): it reads the runner's memory despite the runner being non-dumpable and
    finds the canary task id (the seed itself no longer reaches the runner), signals it, reads
    its environment. So the attack
    detects the cheat that the jails stop. Graded anyway: idle scores 0."""
    port, token = server_port
    needles = _needles(bundle, server_secret, token)
    provider = LocalProvider(f"attacks-control-{secrets.token_hex(4)}", model_uid=None)
    assert provider.model_jail(SandboxSpec()) == ()
    played = _run(_play(bundle, provider, needles, port, solve=False, gentle=True))
    attacks = played.attacks
    assert attacks["mem_read"].startswith("GOT") and "needles [0" in attacks["mem_read"], attacks
    assert attacks["environ"].startswith("GOT needles [2"), attacks  # the server's secret
    assert attacks["signal_0"] == "GOT delivered", attacks
    assert attacks["runner_environ"].startswith("GOT"), attacks
    assert played.scores["correct"] == 0.0, played.scores


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_bwrap_keeps_the_runner_from_the_model(
    bundle: Bundle, server_port: tuple[int, str], server_secret: str, tmp_path: Any
) -> None:
    port, token = server_port
    provider = BwrapProvider(f"attacks-bwrap-{secrets.token_hex(4)}", state_dir=tmp_path)
    _kept_from_the_model_and_graded(bundle, provider, "bwrap", port, server_secret, token)


def test_docker_keeps_the_runner_from_the_model(
    docker_daemon: None, bundle: Bundle, server_port: tuple[int, str], server_secret: str
) -> None:
    from corral.sandboxes.docker import DockerProvider

    port, token = server_port
    provider = DockerProvider(f"attacks-docker-{secrets.token_hex(4)}", image=SANDBOX_IMAGE)
    _kept_from_the_model_and_graded(bundle, provider, "docker", port, server_secret, token)


def test_kubernetes_and_e2b_jails_are_documented_as_empty() -> None:
    """Both backends' jails are empty by decision (docs/sandboxes.md), which this pins so that
    a change to either is a change to the documented threat model; the two tests below play
    the attacks through their stand-ins."""
    from corral.sandboxes.e2b import E2BProvider
    from corral.sandboxes.kubernetes import KubernetesProvider

    for cls in (KubernetesProvider, E2BProvider):
        assert cls.model_jail is SandboxProvider.model_jail, cls
    docs = (ROOT / "docs" / "sandboxes.md").read_text()
    assert "`kubernetes`, `e2b`: the jail is empty for now." in docs


# -- kubernetes and e2b, through their STAND-INS -------------------------------------------------
#
# No cluster and no E2B account here: the real ``kubernetes`` client and the real ``e2b`` SDK
# talk HTTP to the stand-in API servers the backends' own tests use (tests/k8s_standin.py,
# tests/test_sandbox_e2b.py), on 127.0.0.1. With an empty jail the model's commands run as the
# runner's own uid, so what keeps the runner is only its own hardening (non-dumpable, private
# protocol descriptors, a cut environment); the docs say the model can still signal the runner
# and change its uploaded code there: :data:`THROUGH` pins that those get through, so the docs
# stay true. The attacks run gentle (signal 0 only): a SIGKILL would land and end the episode.

# What is kept (docs/sandboxes.md, the kubernetes and e2b columns): the runner's memory, fds
# and environment, tracing it, the verifier. Grading code: never in the payload, so checked on
# kubernetes, whose stand-in Pods see only the host's /usr; the e2b stand-in's processes are
# this host's, which see its whole filesystem (the bundle folders among it): not checkable.
REFUSED["kubernetes"] = (*ALWAYS, "maps", "grading_code")
REFUSED["e2b"] = (*ALWAYS, "maps")
THROUGH = ("signal_0", "pidfd_signal", "code_write")  # same uid: documented as not kept


def _kept_but_reachable(
    bundle: Bundle, make_host: Any, backend: str, port: int, secret: str, token: str
) -> None:
    """Attack a remote backend's sandboxes twice (the reference commands after the attacks,
    graded 1; idle, graded 0): what the docs say is kept must fail, what they say is not
    (:data:`THROUGH`) must get through."""
    needles = _needles(bundle, secret, token)
    for solve in (True, False):
        host = make_host()
        played = _run(
            _play(bundle, host.provider, needles, port, solve=solve, gentle=True, host=host)
        )
        _check(played, backend, needles)
        through = {k: played.attacks[k] for k in THROUGH}
        assert all(v.startswith("GOT") for v in through.values()), (
            f"{backend}: docs/sandboxes.md says these reach the runner there: {through}"
        )
        assert played.attacks["code_write"].startswith(f"GOT {host.code_root}/"), played.attacks
        want = {"correct": 1.0} if solve else {"correct": 0.0, "partial": 0.0}
        assert {k: played.scores[k] for k in want} == want, played.scores


@pytest.fixture(scope="module")
def k8s_standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The kubernetes STAND-IN (tests/k8s_standin.py): an aiohttp server on 127.0.0.1 speaking
    the Kubernetes API to the real client; each Pod a bwrap sandbox (uid 1000, its own pid and
    network namespaces, the host's /usr), every exec in the Pod's one pid namespace."""
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError):
        pytest.skip("the kubernetes stand-in runs Pods in bwrap: pip install pyseccomp")
    if shutil.which("bwrap") is None:
        pytest.skip("the kubernetes stand-in runs Pods in bwrap: apt-get install bubblewrap")
    from tests.k8s_standin import StandIn

    standin = StandIn(tmp_path_factory.mktemp("k8s-standin"), images=(DEFAULT_TAG,))
    standin.start()
    yield standin
    standin.stop()


def test_kubernetes_standin_keeps_the_runners_memory_not_its_signals(
    k8s_standin: Any, bundle: Bundle, server_port: tuple[int, str], server_secret: str
) -> None:
    """The real ``KubernetesProvider`` and ``kubernetes`` client against the STAND-IN API
    server (HTTP and the exec WebSocket on 127.0.0.1; Pods as bwrap sandboxes): the payload
    uploaded to ``/tmp/.corral-env``, the runner and the model's bash both uid 1000 in the Pod.
    The runner's memory, fds, environment, ptrace and the grading code stay out of reach; its
    signals and its uploaded code do not (documented)."""
    from kubernetes import client as k8s

    from corral.sandboxes.kubernetes import KubernetesProvider

    port, token = server_port
    api = k8s.ApiClient(k8s.Configuration(host=k8s_standin.url))
    owner = f"attacks-k8s-{secrets.token_hex(4)}"
    provider = KubernetesProvider(owner, image=DEFAULT_TAG, api_client=api, start_timeout=60)
    spec = SandboxSpec(workdir="/work", ttl_s=600)

    def make_host() -> SandboxHost:
        return SandboxHost(bundle, provider, spec, upload_root=UPLOAD_ROOT)

    _kept_but_reachable(bundle, make_host, "kubernetes", port, server_secret, token)
    assert k8s_standin.unexpected == [], "the backend made a call the stand-in lacks"


E2B_USER_UID = 62817  # the stand-in's "user": a uid of its own on this host (nothing else's)


def _e2b_user_standin(root: Path) -> Any:
    """The e2b STAND-IN (tests/test_sandbox_e2b.py: E2B's control plane, envd and proxy, served
    over HTTP to the real SDK) whose processes run, like a template's default ``user``, as an
    unprivileged uid of their own: the stand-in itself runs them as this test's user, and as
    root that would hand the model ``CAP_SYS_PTRACE`` (the original cheat), which no E2B
    default user has. Commands asked for as ``root`` (the backend's working-folder set-up)
    stay root; files uploaded as the default user are that user's, as in E2B."""
    from e2b.envd.process.process_connect import ProcessASGIApplication

    from tests.test_sandbox_e2b import StandIn, StandInEnvd

    def user_of(authorization: str | None, username: str | None) -> str:
        if username:
            return username
        if authorization and authorization.startswith("Basic "):
            return base64.b64decode(authorization[6:]).decode().split(":", 1)[0]
        return "user"  # no user named: the template's default

    class Envd(StandInEnvd):
        async def start(self, request: Any, ctx: Any) -> Any:
            if user_of(ctx.request_headers.get("authorization"), None) != "root":
                cfg = request.process
                uid = str(E2B_USER_UID)
                jail = ["--reuid", uid, "--regid", uid, "--clear-groups", "--inh-caps=-all"]
                cfg.args = [*jail, "--", cfg.cmd, *cfg.args]
                cfg.cmd = "setpriv"
            async for event in super().start(request, ctx):
                yield event

    class UserStandIn(StandIn):
        def __init__(self, folder: Path) -> None:
            super().__init__(folder)
            self._envd = ProcessASGIApplication(Envd(self))

        async def _write(self, request: Any) -> Any:
            path = self._path(request)
            made = [p for p in path.parents if not p.exists()]
            response = await super()._write(request)
            user = request.headers.get("authorization"), request.query_params.get("username")
            if user_of(*user) != "root":
                for p in (path, *made):
                    os.chown(p, E2B_USER_UID, E2B_USER_UID)
            return response

    return UserStandIn(root)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="the e2b stand-in's user: setpriv")
def test_e2b_standin_keeps_the_runners_memory_not_its_signals(
    bundle: Bundle, server_port: tuple[int, str], server_secret: str
) -> None:
    """The real ``E2BProvider`` and ``e2b`` SDK against the STAND-IN of E2B (HTTP on
    127.0.0.1; its sandboxes this host's processes, here as the template user's own uid, see
    :func:`_e2b_user_standin`): the payload uploaded as that user, the runner and the model's
    bash both that uid. The runner's memory, fds, environment and ptrace stay out of reach;
    its signals and its uploaded code do not (documented)."""
    pytest.importorskip("e2b", reason="the e2b SDK is not installed (pip install 'corral[e2b]')")
    if os.geteuid() != 0:
        pytest.skip("the stand-in's user is a uid of its own: needs root to switch to it")
    from tests.servers import serve
    from tests.test_sandbox_e2b import make_provider

    port, token = server_port
    # Not under pytest's tmp_path (0700 root): the user must reach its home and working folder.
    root = Path(tempfile.mkdtemp(prefix="corral-e2b-attacks-"))
    root.chmod(0o755)
    service = _e2b_user_standin(root / "e2b")
    try:
        with serve(service) as url:
            service.url = url
            provider = make_provider(service)
            # The stand-in's sandboxes share this host's folders: one working folder each.
            workdirs = (str(root / f"work{n}") for n in range(2))

            def make_host() -> SandboxHost:
                spec = SandboxSpec(workdir=next(workdirs), ttl_s=600)
                return SandboxHost(bundle, provider, spec, upload_root=str(root / "code"))

            try:
                _kept_but_reachable(bundle, make_host, "e2b", port, server_secret, token)
            finally:
                for sid in list(service.sandboxes):
                    service.kill_now(sid)
    finally:
        shutil.rmtree(root, ignore_errors=True)
