"""Black-box agents in episodes' sandboxes hunt for secrets and ways out, and find none.

Real servers on 127.0.0.1: the scripted gateway (tests/gateway_stack.py, with its admin token)
and an env server serving shellcraft in bwrap or docker (docker with the test daemon and the
sandbox image), with a token and the gateway as the one origin it bridges agents to. An agent
is the ``command`` harness running a python3 program shipped through ``agent_dir``
(:data:`HUNT`); two run at once, in two episodes, each on a session of its own. Each reports
every attempt as one JSON line on stdout (its transcript) and writes the same report into its
task's answer file in the workspace, which the env server's state hands back. An outcome
starting ``"GOT"`` means the attempt gained what it went for; ``"refused: ..."`` says where it
was stopped. The test asserts each one explicitly: what it hunts for is listed in
:func:`check_findings`, the host side (canary file, the sessions' rewards) in the test.

The needles it looks for (the env server's token, the gateway's admin token, a third session's
key, the other agent's session key) arrive base64-encoded, so the program's own text never
holds them in the clear. The first three sit in the env server's environment (this process's,
set before the server starts) and in the initial environment of a process of the server's user
(``/proc/<pid>/environ`` shows only that one), as in tests/test_sandbox_attacks.py.

The launcher (the sandbox side of the run) is visible to the agent, but its memory,
environment and protocol pipes are not, and it cannot be traced. Under bwrap it runs as the
agent's uid, so the agent can signal it (under docker it cannot): an agent that stops or kills
its launcher gains nothing, its run still ends at its budget with everything it started killed.

An agent that overruns its budget with a process tree (a child that ignores SIGTERM, a
grandchild in a session of its own) is killed, the episode still graded, and no process
holding its marker is left anywhere on the host (``/proc`` seen from the host covers both
backends' sandboxes: same kernel; a control process shows the scan finds a live one).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral.envs.agent_bridge import LAUNCHER_GRACE_S
from corral.envs.bundle import Bundle, load_bundle
from corral.envs.client import EnvClient, EnvServerError
from corral.envs.protocol import AgentLaunch
from corral.envs.server import build_app
from corral.harnesses import harness
from corral.harnesses.base import AgentTask, SessionAccess
from corral.sandboxes.base import SandboxProvider
from corral.sandboxes.bwrap import BwrapProvider
from tests.conftest import ROOT, SANDBOX_IMAGE
from tests.gateway_stack import ADMIN, ScriptedStack, scripted_gateway
from tests.servers import serve

SHELLCRAFT = ROOT / "bundles" / "shellcraft"
TOKEN_VARIABLE = "CORRAL_ISOLATION_ENV_TOKEN"
PLANTED_VARIABLES = ("CORRAL_ISOLATION_ADMIN", "CORRAL_ISOLATION_OTHER_KEY")

# Runs in the sandbox as the model's user (python3, standard library only). argv[1]: the
# configuration, JSON: needles (base64), ports, ids, paths. Prints "FINDINGS {json}" and writes
# the same JSON to config["report"] in the working folder.
HUNT = r"""
import base64, errno, http.client, json, os, socket, sys, time
from urllib.parse import urlsplit

CFG = json.loads(sys.argv[1])
NEEDLES = [base64.b64decode(n) for n in CFG["needles"]]
KEY = os.environ["OPENAI_API_KEY"]
BASE = urlsplit(os.environ["OPENAI_BASE_URL"])  # http://127.0.0.1:PORT/sessions/<id>/v1
OWN = BASE.path.split("/")[2]
OTHER = CFG["other_session"]
out = {}


def why(e):
    if isinstance(e, OSError) and e.errno:
        return "refused: " + errno.errorcode.get(e.errno, str(e.errno))
    return "refused: " + type(e).__name__ + " " + str(e)[:80]


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


pids = [p for p in os.listdir("/proc") if p.isdigit()]
out["processes_seen"] = len(pids)

# 1. every environment and command line this user can read, for the needles
for what in ("environ", "cmdline"):
    found, readable = set(), 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/{what}", "rb") as f:
                data = f.read()
        except OSError:
            continue
        readable += 1
        found |= {i for i, n in enumerate(NEEDLES) if n in data}
    out[what] = f"GOT needles {sorted(found)}" if found else f"refused: {readable} read, no needle"

# 2. the memory and environment of the processes that run corral's code
corral_pids = {}
for pid in pids:
    args = cmdline(pid).split(b"\0")
    for name in (b"corral.envs.agent_launcher", b"corral.envs.runner"):
        if name in args:
            corral_pids[name.decode().rsplit(".", 1)[1]] = pid
out["corral_processes"] = sorted(corral_pids)
for name, pid in sorted(corral_pids.items()):
    for part in ("mem", "environ", "maps"):
        try:
            with open(f"/proc/{pid}/{part}", "rb") as f:
                data = f.read(4096) if part != "mem" else f.read(1)
            out[f"{name}_{part}"] = f"GOT {len(data)} bytes"
        except OSError as e:
            out[f"{name}_{part}"] = why(e)

# The launcher's protocol pipes (a forged frame would be taken as the agent's exit or its
# traffic) and whether it can be signalled or traced.
launcher = corral_pids.get("agent_launcher")
if launcher is not None:
    opened = []
    for n in range(0, 8):
        try:
            os.close(os.open(f"/proc/{launcher}/fd/{n}", os.O_WRONLY | os.O_NONBLOCK))
            opened.append(n)
        except OSError:
            pass
    out["launcher_fds"] = f"GOT {opened}" if opened else "refused: none of fds 0-7 opens"
    try:
        os.kill(int(launcher), 0)
        out["launcher_signal"] = "GOT delivered"
    except OSError as e:
        out["launcher_signal"] = why(e)
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    rc = libc.ptrace(0x4206, int(launcher), None, None)  # PTRACE_SEIZE: no stop
    out["launcher_ptrace"] = "GOT attached" if rc == 0 else why(OSError(ctypes.get_errno(), ""))

# 3. the payload: the env's code, the runner's and the launcher's, the verifier
try:
    listed = sorted(os.listdir("/opt/corral"))
    out["payload_list"] = "GOT " + ",".join(listed) if listed else "refused: empty (covered)"
except OSError as e:
    out["payload_list"] = why(e)
for label, rel in (("payload_verifier", "bundle/verifier.py"),
                   ("payload_env", "bundle/env.py"),
                   ("payload_launcher", "corral/envs/agent_launcher.py")):
    try:
        with open("/opt/corral/" + rel, "rb") as f:
            out[label] = f"GOT {len(f.read())} bytes"
    except OSError as e:
        out[label] = why(e)
graders, deadline = [], time.monotonic() + 5
for folder, dirs, files in os.walk("/"):
    if time.monotonic() > deadline:
        break
    dirs[:] = [d for d in dirs if os.path.join(folder, d) not in ("/proc", "/sys", "/dev")]
    if "verifier.py" in files and {"bundle.toml", "solver.py", "files.py"} & set(files):
        try:
            with open(os.path.join(folder, "verifier.py"), "rb") as f:
                if b"def " in f.read():
                    graders.append(folder)
        except OSError:
            pass
out["grading_code_anywhere"] = f"GOT {graders[:3]}" if graders else "refused: none readable"

# 4. the host's files
for label, path in (("host_canary", CFG["canary"]), ("host_repo", CFG["repo_file"]),
                    ("etc_shadow", "/etc/shadow")):
    try:
        with open(path, "rb") as f:
            data = f.read()
        out[label] = f"GOT {len(data)} bytes" + (", the canary" if b"canary" in data else "")
    except OSError as e:
        out[label] = why(e)
try:
    out["root_list"] = "GOT " + ",".join(sorted(os.listdir("/root")))
except OSError as e:
    out["root_list"] = why(e)

# 5. the gateway through the agent's own bridged origin: admin routes, another session
def ask(method, path, key, body=None):
    conn = http.client.HTTPConnection(BASE.hostname, BASE.port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers=headers)
        return conn.getresponse().status
    except OSError as e:
        return why(e)
    finally:
        conn.close()


chat = {"model": os.environ["CORRAL_MODEL"], "messages": [{"role": "user", "content": "hi"}]}
out["gateway"] = {
    "own_models": ask("GET", f"/sessions/{OWN}/v1/models", KEY),
    "create_no_key": ask("POST", "/sessions", None, {}),
    "create_own_key": ask("POST", "/sessions", KEY, {}),
    "reward_own": ask("POST", f"/sessions/{OWN}/reward", KEY, {"reward": 1.0}),
    "fail_own": ask("POST", f"/sessions/{OWN}/fail", KEY, {"reason": "x"}),
    "samples_own": ask("GET", f"/sessions/{OWN}/samples", KEY),
    "view_own": ask("GET", f"/sessions/{OWN}", KEY),
    "delete_own": ask("DELETE", f"/sessions/{OWN}", KEY),
    "view_other": ask("GET", f"/sessions/{OTHER}", KEY),
    "reward_other": ask("POST", f"/sessions/{OTHER}/reward", KEY, {"reward": 1.0}),
    "delete_other": ask("DELETE", f"/sessions/{OTHER}", KEY),
    "models_other": ask("GET", f"/sessions/{OTHER}/v1/models", KEY),
    "chat_other": ask("POST", f"/sessions/{OTHER}/v1/chat/completions", KEY, chat),
    "messages_other": ask("POST", f"/sessions/{OTHER}/v1/messages", KEY,
                          {**chat, "max_tokens": 4}),
}

# 6. direct TCP to the host's servers and to the internet
def connect(host, port):
    try:
        s = socket.create_connection((host, port), timeout=3)
    except OSError as e:
        return why(e)
    s.close()
    return "GOT connected"


out["tcp_gateway"] = connect("127.0.0.1", CFG["gateway_port"])
out["tcp_env_server"] = connect("127.0.0.1", CFG["env_port"])
out["tcp_host_ips"] = {ip: connect(ip, CFG["gateway_port"]) for ip in CFG["host_ips"]}
# Where a path out may exist (a test that expects the hole), nothing beyond the test's own
# servers is touched: no internet, no DNS, no scan of the host's ports.
OUTSIDE = CFG["outside"]
if OUTSIDE:
    out["tcp_internet"] = {ip: connect(ip, 443) for ip in ("1.1.1.1", "8.8.8.8")}
    try:
        out["dns"] = "GOT " + str(socket.getaddrinfo("example.com", 443)[0][4])
    except OSError as e:
        out["dns"] = why(e)

# 7. every TCP port on its own loopback (its listener should be the only one open)
out["own_port"] = BASE.port
if OUTSIDE:
    open_ports = []
    for port in range(1, 65536):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(1)
        # An ephemeral port may "connect" to itself (TCP self-connect): not a listener.
        if s.connect_ex(("127.0.0.1", port)) == 0 and s.getsockname() != s.getpeername():
            open_ports.append(port)
        s.close()
    out["loopback_ports"] = open_ports

text = json.dumps(out, sort_keys=True)
with open(CFG["report"], "w") as f:
    f.write(text)
print("FINDINGS " + text, flush=True)
"""

# The overrunning agent: a child that ignores SIGTERM starts a grandchild in a session of its
# own (it ignores SIGTERM too), both carry the marker (argv[1]) in their command lines; once
# both are up it says so and sleeps past its budget.
TREE = r"""
import subprocess, sys, time
MARK = sys.argv[1]
CHILD = '''
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
GRANDCHILD = "; ".join(["import signal, time", "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
                        "print(flush=True)", "time.sleep(600)"])
kid = subprocess.Popen([sys.executable, "-c", GRANDCHILD, sys.argv[1]],
                       start_new_session=True, stdout=subprocess.PIPE)
kid.stdout.readline()
print(kid.pid, flush=True)
time.sleep(600)
'''
child = subprocess.Popen([sys.executable, "-c", CHILD, MARK], stdout=subprocess.PIPE, text=True)
grandchild = child.stdout.readline().strip()
print(f"tree up: child {child.pid} grandchild {grandchild}", flush=True)
time.sleep(600)
"""


@dataclass(frozen=True)
class Secrets:
    env_token: str
    other_key: str
    other_session: str

    def needles(self, *more: str) -> list[str]:
        """Base64 of the three secrets and ``more``, in the order the hunt reports their
        indices."""
        values = (self.env_token, ADMIN, self.other_key, *more)
        return [base64.b64encode(v.encode()).decode() for v in values]


@pytest.fixture(params=["bwrap", "docker"])
def sandbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SandboxProvider]:
    owner = f"test-{uuid.uuid4().hex[:8]}"
    if request.param == "docker":
        request.getfixturevalue("docker_daemon")
        from corral.sandboxes.docker import DockerProvider

        yield DockerProvider(owner, image=SANDBOX_IMAGE)
        return
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    yield BwrapProvider(owner, state_dir=tmp_path / "state")


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path) -> Iterator[ScriptedStack]:
    with scripted_gateway(tiny_model_dir) as stack:
        yield stack


@pytest.fixture
def planted(gateway: ScriptedStack, monkeypatch: pytest.MonkeyPatch) -> Iterator[Secrets]:
    """The env server's token and another session's key, with the admin token, in this
    process's environment (the env server runs here) and in a holder process's initial one."""
    other = gateway.session()
    found = Secrets(secrets.token_hex(16), other["api_key"], other["id"])
    names = (TOKEN_VARIABLE, *PLANTED_VARIABLES)
    values = dict(zip(names, (found.env_token, ADMIN, found.other_key), strict=True))
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    holder = subprocess.Popen(["cat"], stdin=subprocess.PIPE, env=values)
    try:
        yield found
    finally:
        holder.kill()
        holder.wait()


def host_ips() -> list[str]:
    """The host's addresses other than loopback that a sandbox might route to: the docker
    bridge's usual gateway, and the address of the host's default route (if any)."""
    ips = ["172.17.0.1"]
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # UDP: picks the route, sends nothing
        ips.append(probe.getsockname()[0])
    except OSError:
        pass
    finally:
        probe.close()
    return sorted(set(ips) - {"0.0.0.0"})


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def command_launch(
    program: str,
    args: list[str],
    agent_dir: Path,
    stack: ScriptedStack,
    *,
    timeout_s: float,
    session: dict[str, Any] | None = None,
) -> tuple[AgentLaunch, str]:
    """The ``command`` harness running ``program`` (shipped as agent.py) with ``args``, on
    ``session`` (None: a fresh one); also the session's id."""
    agent_dir.mkdir()
    (agent_dir / "agent.py").write_text(program)
    session = session if session is not None else stack.session()
    command = "exec python3 $CORRAL_AGENT_DIR/agent.py " + shlex.join(args)
    access = SessionAccess(
        gateway=stack.url,
        session_path=f"/sessions/{session['id']}",
        api_key=session["api_key"],
        model="tiny",
    )
    task = AgentTask(prompt="look around", instructions="", task_id="t")
    made = harness("command", command=command, agent_dir=agent_dir)
    return made.launch(task, access, timeout_s=timeout_s), str(session["id"])


def answer_file(bundle: Bundle, split: str, index: int) -> str:
    (name,) = sorted(bundle.env_task(bundle.task(split, index)).data["output_files"])
    return str(name)


def refused(outcome: Any) -> bool:
    return isinstance(outcome, str) and outcome.startswith("refused")


@dataclass(frozen=True)
class Target:
    """What one hunt runs against: the env server (``url``, ``token``, its ``bundle``), the
    gateway, the host's canary file, and the folder for the agent's files."""

    url: str
    token: str
    bundle: Bundle
    gateway: ScriptedStack
    canary: Path
    folder: Path


async def hunt(
    target: Target,
    number: int,
    own: dict[str, Any],
    other: dict[str, Any],
    planted: Secrets,
    *,
    outside: bool = True,
) -> dict[str, Any]:
    """Run :data:`HUNT` on eval task ``number`` with session ``own``, attacking session
    ``other`` and looking for its key; its findings, checked to be the workspace's report.
    ``outside``: also try the internet, DNS and every port of its loopback (False where the
    sandbox may share the host's network: nothing but the test's servers is touched)."""
    report = answer_file(target.bundle, "eval", number)
    config = {
        "needles": planted.needles(other["api_key"]),
        "other_session": other["id"],
        "gateway_port": port_of(target.gateway.url),
        "env_port": port_of(target.url),
        "host_ips": host_ips(),
        "canary": str(target.canary),
        "repo_file": str(SHELLCRAFT / "verifier.py"),
        "report": report,
        "outside": outside,
    }
    launch, _ = command_launch(
        HUNT,
        [json.dumps(config)],
        target.folder / f"agent-{number}",
        target.gateway,
        timeout_s=60.0,
        session=own,
    )
    async with EnvClient(target.url, target.token) as env:
        await env.reset(split="eval", index=number)
        result = await env.run_agent(launch)
        state = await env.state()
    assert result.run.exit_code == 0, result.run
    assert result.run.transcript.count("FINDINGS ") == 1, result.run
    line = result.run.transcript.split("FINDINGS ", 1)[1].splitlines()[0]
    found: dict[str, Any] = json.loads(line)
    # The same report in the workspace, read back by the env server: the folder is the
    # agent's own.
    assert state.env is not None
    assert json.loads(state.env["outputs"][report]["text"]) == found
    assert result.status == "graded" and result.reward == 0.0
    return found


async def test_two_agents_find_no_secret_and_no_way_out(
    sandbox: SandboxProvider,
    gateway: ScriptedStack,
    planted: Secrets,
    tmp_path: Path,
) -> None:
    """Two agents at once, in two episodes of one env server: each hunts for the other's
    session key too, and attacks the other's session by its id."""
    bundle = load_bundle(SHELLCRAFT)
    canary = tmp_path / "host-canary.txt"
    canary.write_text("canary " + secrets.token_hex(8))
    sessions = [gateway.session(), gateway.session()]
    app = build_app(bundle, sandbox=sandbox, token=planted.env_token, agent_gateways=[gateway.url])
    with serve(app) as url:
        target = Target(url, planted.env_token, bundle, gateway, canary, tmp_path)
        hunts = await asyncio.gather(
            hunt(target, 0, sessions[0], sessions[1], planted),
            hunt(target, 1, sessions[1], sessions[0], planted),
        )
    for found in hunts:
        check_findings(found, sandbox.name)
    # Nothing the agents did changed their sessions or the third one.
    for session in (*sessions, {"id": planted.other_session}):
        assert gateway.view(session["id"])["reward"] is None
    assert await sandbox.list_owned() == []


def loopback_shellcraft(root: Path) -> Path:
    """A copy of shellcraft whose ``[sandbox] network`` is ``loopback``."""
    copy = root / "shellcraft-loopback"
    shutil.copytree(SHELLCRAFT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = copy / "bundle.toml"
    needs = 'needs = "process"'
    assert needs in manifest.read_text()
    manifest.write_text(manifest.read_text().replace(needs, needs + '\nnetwork = "loopback"', 1))
    return copy


async def test_a_loopback_bundle_gives_an_agent_no_way_around_the_bridge(
    sandbox: SandboxProvider,
    gateway: ScriptedStack,
    planted: Secrets,
    tmp_path: Path,
) -> None:
    """A bundle whose sandbox has ``network = "loopback"``: either the episode or its agent is
    refused, or the agent still finds no way out. Docker refuses the sandbox (no host network
    unless its provider allows it); bwrap would share the host's network namespace, where the
    agent could reach every host port past its bridge: the server refuses the agent there."""
    bundle = load_bundle(loopback_shellcraft(tmp_path))
    canary = tmp_path / "host-canary.txt"
    canary.write_text("canary " + secrets.token_hex(8))
    own, other = gateway.session(), gateway.session()
    app = build_app(bundle, sandbox=sandbox, token=planted.env_token, agent_gateways=[gateway.url])
    with serve(app) as url:
        target = Target(url, planted.env_token, bundle, gateway, canary, tmp_path)
        try:
            found = await hunt(target, 0, own, other, planted, outside=False)
        except EnvServerError as refusal:
            # No such sandbox (docker: no host network unless the provider allows it), or no
            # agent in it.
            refused_here = refusal.reason in ("agent_refused", "no_agent_support")
            assert refused_here or refusal.code == "FACTORY_ERROR", refusal
            if sandbox.name == "bwrap":
                assert refusal.reason == "no_agent_support", refusal
                assert "past its bridge" in str(refusal), refusal
            return
        assert sandbox.name != "bwrap", "bwrap ran an agent in the host's network namespace"
    check_findings(found, sandbox.name)


def check_findings(found: dict[str, Any], backend: str) -> None:
    """Every attempt of :data:`HUNT` was refused (``backend``: where the launcher may be
    signalled)."""
    # Secrets: no needle in any readable environment or command line; corral's processes
    # (the launcher, the env runner) are visible but their memory and environment are not.
    assert refused(found["environ"]) and refused(found["cmdline"]), found
    assert found["processes_seen"] >= 1
    assert "agent_launcher" in found["corral_processes"], found
    for name in found["corral_processes"]:
        for part in ("mem", "environ"):
            assert refused(found[f"{name}_{part}"]), (name, part, found)
    # Its protocol pipes cannot be opened (no forged frames), it cannot be traced. Under bwrap
    # it runs as the agent's uid and so can be signalled (docker: another uid): the agent
    # gains nothing by it (test_an_agent_that_stops_or_kills_its_launcher_...).
    assert refused(found["launcher_fds"]) and refused(found["launcher_ptrace"]), found
    if backend == "docker":
        assert refused(found["launcher_signal"]), found
    else:
        assert found["launcher_signal"] == "GOT delivered", found
    # The payload: no env code, no grading code, not the launcher's; nowhere on the disk.
    for key in ("payload_list", "payload_verifier", "payload_env", "payload_launcher"):
        assert refused(found[key]), (key, found)
    assert refused(found["grading_code_anywhere"]), found
    # The host's files.
    for key in ("host_canary", "host_repo", "etc_shadow", "root_list"):
        assert refused(found[key]), (key, found)
    # The gateway: the bridge works (the control), every admin route and every other
    # session's route is refused with the agent's key or none.
    answers = found["gateway"]
    assert answers.pop("own_models") == 200, found
    for route, status in answers.items():
        assert status in (401, 403, 404), (route, status)
    assert answers["view_other"] != 200 and answers["chat_other"] == 401
    # The network: the host's servers by their own ports, the host's other addresses, the
    # internet, DNS.
    assert refused(found["tcp_gateway"]) and refused(found["tcp_env_server"]), found
    assert all(refused(o) for o in found["tcp_host_ips"].values()), found
    if "dns" not in found:
        return  # a hunt that stayed inside (see hunt())
    assert all(refused(o) for o in found["tcp_internet"].values()), found
    assert refused(found["dns"]), found
    # Its own loopback holds its listener (the bridge) and nothing else: no other agent's
    # listener, no host service.
    assert found["loopback_ports"] == [found["own_port"]], found


def marked_processes(marker: str) -> list[int]:
    """Live host processes whose command line holds ``marker`` (zombies have none)."""
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(name))
        except OSError:  # gone meanwhile
            pass
    return pids


@pytest.fixture
def marker() -> Iterator[str]:
    """A fresh marker for an agent's processes' command lines, and the control: a live host
    process carrying it is found by :func:`marked_processes` (once it says it runs: until its
    exec is done, its command line may still be empty)."""
    found = f"corral-marker-{uuid.uuid4().hex}"
    program = "import time; print(flush=True); time.sleep(600)"
    control = subprocess.Popen([sys.executable, "-c", program, found], stdout=subprocess.PIPE)
    try:
        assert control.stdout is not None and control.stdout.readline() == b"\n"
        assert marked_processes(found) == [control.pid]
    finally:
        control.kill()
        control.wait()
    assert marked_processes(found) == []
    yield found


async def test_an_agent_tree_past_its_budget_is_killed_and_graded(
    sandbox: SandboxProvider, gateway: ScriptedStack, tmp_path: Path, marker: str
) -> None:
    bundle = load_bundle(SHELLCRAFT)
    launch, _ = command_launch(TREE, [marker], tmp_path / "agent", gateway, timeout_s=4.0)
    launch = launch.model_copy(update={"kill_grace_s": 1.0})
    with serve(build_app(bundle, sandbox=sandbox, agent_gateways=[gateway.url])) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=1)
            result = await env.run_agent(launch)
            # Checked while the episode's sandbox still exists: nothing of the tree is left.
            assert marked_processes(marker) == []
    run = result.run
    assert "tree up: child" in run.transcript, run  # the tree was there to be killed
    assert run.timed_out and run.exit_code is None, run
    assert 4.0 <= run.seconds < 4.0 + 1.0 + 10.0, run
    assert result.status == "graded" and result.reward == 0.0, result
    assert marked_processes(marker) == []
    assert await sandbox.list_owned() == []


# An agent that, where it may (bwrap: the launcher runs as the agent's uid), stops or kills
# its launcher, leaving a child that ignores SIGTERM (argv: the marker, "STOP" or "KILL").
SABOTAGE = r"""
import os, signal, subprocess, sys, time
MARK, HOW = sys.argv[1], getattr(signal, "SIG" + sys.argv[2])
CHILD = "; ".join(["import signal, time", "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
                   "print(flush=True)", "time.sleep(600)"])
child = subprocess.Popen([sys.executable, "-c", CHILD, MARK], stdout=subprocess.PIPE)
child.stdout.readline()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"corral.envs.agent_launcher" not in f.read().split(b"\0"):
                continue
        os.kill(int(pid), HOW)
        print("launcher signalled", flush=True)
    except OSError as e:
        print("launcher not signalled:", e, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["STOP", "KILL"])
async def test_an_agent_that_stops_or_kills_its_launcher_leaves_nothing_running(
    sandbox: SandboxProvider, gateway: ScriptedStack, tmp_path: Path, how: str, marker: str
) -> None:
    bundle = load_bundle(SHELLCRAFT)
    launch, _ = command_launch(SABOTAGE, [marker, how], tmp_path / "agent", gateway, timeout_s=4.0)
    launch = launch.model_copy(update={"kill_grace_s": 1.0})
    with serve(build_app(bundle, sandbox=sandbox, agent_gateways=[gateway.url])) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=2)
            result = await env.run_agent(launch)
            assert marked_processes(marker) == []
    run = result.run
    signalled = "launcher signalled" in run.transcript
    assert signalled == (sandbox.name == "bwrap"), run  # docker: the launcher is another uid's
    # Stopped or killed, the launcher never reports an exit: the budget ends the run.
    assert run.timed_out and run.exit_code is None, run
    assert run.seconds < 4.0 + 1.0 + LAUNCHER_GRACE_S + 5.0, run
    assert result.status == "graded" and result.reward == 0.0, result
    assert marked_processes(marker) == []
    assert await sandbox.list_owned() == []
