"""Black-box agents as adversaries: hostile launches (from a client holding the env token) and
hostile agents (the agent, and the model behind it).

The launches' refusals are checked on :func:`corral.envs.agent_bridge.check_launch` (no
sandbox needed: nothing is started for a refused launch). The agents run for real in bwrap
through :func:`corral.envs.agent_bridge.run_agent`, with a real HTTP server on 127.0.0.1 as
the gateway: an agent that opens more connections than the launcher can serve, one that has
used up its sandbox's pids limit, and one whose sandbox has a link planted where the agent's
folders go. Each must get a fast, visible failure (a reset connection, a refused file), never
a silent hang or a write outside its folders.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral.envs.agent_bridge import (
    MAX_LINK_BUFFER,
    MAX_RUN_BUFFER,
    AgentPolicy,
    AgentRefused,
    check_launch,
    run_agent,
)
from corral.envs.agent_launcher import MAX_CONNECTIONS
from corral.envs.bundle import load_bundle
from corral.envs.client import EnvClient
from corral.envs.hosting import CODE_ROOT, build_payload
from corral.envs.protocol import AGENT_DIR, AGENT_ROOT, GATEWAY_PLACEHOLDER, AgentFile, AgentLaunch
from corral.envs.server import build_app
from corral.sandboxes.base import Bind, Sandbox, SandboxSpec
from corral.sandboxes.bwrap import BwrapProvider
from tests.conftest import ROOT
from tests.servers import serve, stand_in_gateway

WORKDIR = "/work"
LOOPBACK = "http://127.0.0.1:8000"


def _file(path: str, content: bytes, area: str = "agent_dir") -> AgentFile:
    return AgentFile(area=area, path=path, content_b64=base64.b64encode(content).decode())  # type: ignore[arg-type]


def _launch(script: str = "", **fields: Any) -> AgentLaunch:
    return AgentLaunch(
        harness="command",
        argv=fields.pop("argv", ["python3", f"{AGENT_DIR}/agent.py", GATEWAY_PLACEHOLDER]),
        files=fields.pop("files", [_file("agent.py", script.encode())]),
        gateway=fields.pop("gateway", LOOPBACK),
        timeout_s=fields.pop("timeout_s", 60.0),
        **fields,
    )


# -- hostile launches: refused before anything starts ---------------------------------------


@pytest.mark.parametrize(
    "origin",
    [
        "http://127.0.0.1@evil.example",  # credentials: the host is evil.example
        "http://evil.example#@127.0.0.1",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:0",
        "http://[::1]:0",
        "http://0x7f.1",  # inet_aton would read it as 127.0.0.1; it is no IP address
        "http://2130706433",
        "http://10.0.0.5:8000",
        "http://localhost.:8000",
        "ftp://127.0.0.1:21",
        "http://127.0.0.1:8000/sessions/x",
        "http://127.0.0.1:8000?x=1",
        "http://:8000",
    ],
)
def test_a_gateway_that_is_no_loopback_origin_is_refused(origin: str) -> None:
    with pytest.raises(AgentRefused):
        check_launch(_launch(gateway=origin), AgentPolicy())


def test_port_zero_never_matches_a_named_gateway() -> None:
    """``:0`` once normalised to the scheme's default port: it matched ``host:80``."""
    policy = AgentPolicy(gateways=("http://gw.internal:80",))
    assert check_launch(_launch(gateway="http://gw.internal"), policy).port == 80
    with pytest.raises(AgentRefused, match="port 0"):
        check_launch(_launch(gateway="http://gw.internal:0"), policy)


@pytest.mark.parametrize(
    "fields",
    [
        {"argv": ["python3", "a\0b"]},
        {"env": {"A": "x\0y"}},
        {"env": {"A=B": "x"}},
        {"env": {"": "x"}},
        {"env": {"1A": "x"}},
        {"env": {"A B": "x"}},
        {"files": [_file("a/../b", b"")]},
        {"files": [_file("./x", b"")]},
        {"files": [_file("/etc/passwd", b"", area="home")]},
        {"files": [_file("a//b", b"")]},
        {"files": [_file("a/", b"")]},
        {"files": [_file("x", b""), _file("x", b"")]},
        {"files": [AgentFile(path="x", content_b64="not base64!")]},
        {"files": [AgentFile(path="x", content_b64="QQ")]},  # unpadded
        {"files": [_file(f"f{i}", b"x" * 2**20) for i in range(33)]},  # 33 MiB in all
        {"timeout_s": float("inf")},
        {"timeout_s": 1e308},
    ],
    ids=lambda f: next(iter(f)),
)
def test_hostile_launch_fields_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(AgentRefused):
        check_launch(_launch(**fields), AgentPolicy())


def test_nan_budgets_do_not_validate() -> None:
    """NaN compares false with every bound: it must not slip past the budget cap as a
    timer that never fires (or that corrupts the event loop's timer heap)."""
    base = _launch().model_dump(mode="json")
    for field in ("timeout_s", "kill_grace_s"):
        with pytest.raises(ValueError):
            AgentLaunch.model_validate_json(json.dumps({**base, field: float("nan")}))
    with pytest.raises(ValueError):
        AgentLaunch.model_validate({**base, "kill_grace_s": float("inf")})


# -- hostile agents in bwrap ----------------------------------------------------------------


@pytest.fixture
async def gateway() -> AsyncIterator[str]:
    """A real HTTP server on 127.0.0.1 standing as the gateway: it answers every request."""
    async with stand_in_gateway() as gw:
        yield gw.origin


@pytest.fixture(scope="module")
def payload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_payload(load_bundle(ROOT / "bundles" / "shellcraft"), tmp_path_factory.mktemp("p"))


class Box:
    """A live bwrap sandbox (its payload bound at CODE_ROOT) that runs launches."""

    def __init__(self, sandbox: Sandbox, jail: tuple[str, ...]) -> None:
        self.sandbox = sandbox
        self.jail = jail

    async def run(self, launch: AgentLaunch) -> Any:
        return await run_agent(
            self.sandbox,
            launch,
            python="python3",
            code_root=CODE_ROOT,
            jail=self.jail,
            workdir=WORKDIR,
            policy=AgentPolicy(),
        )


@pytest.fixture
async def box(payload: Path, tmp_path: Path) -> AsyncIterator[Box]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    provider = BwrapProvider(f"agent-adv-{uuid.uuid4().hex[:6]}", tmp_path / "state")
    spec = SandboxSpec(workdir=WORKDIR, binds=(Bind(source=payload, target=CODE_ROOT),))
    sandbox = await provider.create(spec)
    try:
        yield Box(sandbox, tuple(provider.model_jail(spec)))
    finally:
        await sandbox.close()
        assert await provider.list_owned() == []


# What the agents share: one request through the bridge, and a probe that tells a connection
# the bridge serves (held open: the request is never finished) from one it resets.
COMMON = r"""
import json, os, socket, subprocess, sys, time
from urllib.parse import urlsplit
url = urlsplit(sys.argv[1])


def ask(path):
    s = socket.create_connection((url.hostname, url.port), timeout=10)
    try:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data.decode(errors="replace").rsplit("\n", 1)[-1]
    except OSError as exc:
        return f"failed: {exc!r}"
    finally:
        s.close()


def probe(wait):
    # 'held' (bridged: the gateway waits for the rest), 'reset', or 'hung' (nobody answers).
    s = socket.socket()
    s.settimeout(wait)
    try:
        s.connect((url.hostname, url.port))
        s.sendall(b"GET /v1/held HTTP/1.1\r\nHost: g\r\n")
        return ("reset" if s.recv(10) == b"" else "answered"), None
    except socket.timeout:
        return "held", s
    except OSError:
        return "reset", None
"""

FLOOD = (
    COMMON
    + r"""
held, outcomes = [], []
for _ in range(int(sys.argv[2])):
    outcome, sock = probe(0.2)
    outcomes.append(outcome)
    if sock is not None:
        held.append(sock)
for s in held:
    s.close()
time.sleep(0.3)
counts = {o: outcomes.count(o) for o in set(outcomes)}
print(json.dumps({"counts": counts, "after": ask("/v1/after")}))
"""
)


async def test_a_connection_flood_is_reset_not_left_hanging(box: Box, gateway: str) -> None:
    """Each connection costs the launcher two threads, and bwrap's pids limit is 256: past
    about 120 connections the launcher's accept loop died and every later connection of the
    agent hung in the listener's backlog. Now at most MAX_CONNECTIONS are bridged at once;
    the others are reset at once, and the bridge serves the agent again once it lets go."""
    argv = ["python3", f"{AGENT_DIR}/agent.py", GATEWAY_PLACEHOLDER, "200"]
    run = await box.run(_launch(FLOOD, argv=argv, gateway=gateway))
    assert run.exit_code == 0, run
    report = json.loads(run.transcript)
    assert report["counts"] == {"held": MAX_CONNECTIONS, "reset": 200 - MAX_CONNECTIONS}
    assert report["after"] == "reply to /v1/after"
    assert run.gateway_connections == MAX_CONNECTIONS + 1


PIDS = (
    COMMON
    + r"""
children = []
try:
    while len(children) < 2000:
        children.append(subprocess.Popen(["sleep", "120"]))
except OSError:
    pass  # the pids limit: no process (and no thread) more in this sandbox
at_limit, _ = probe(5.0)
for child in children:
    child.kill()
for child in children:
    child.wait()
print(json.dumps({"children": len(children), "at_limit": at_limit, "after": ask("/v1/after")}))
"""
)


async def test_an_agent_at_its_pids_limit_gets_a_reset_not_a_hang(box: Box, gateway: str) -> None:
    """With the sandbox's pids used up the launcher cannot start a connection's threads:
    the connection is reset (it was accepted into a dead loop and hung), and once the agent
    frees processes its connections are bridged again."""
    run = await box.run(_launch(PIDS, gateway=gateway))
    assert run.exit_code == 0, run
    report = json.loads(run.transcript)
    assert 100 < report["children"] < 2000, report  # the limit was hit
    assert report["at_limit"] == "reset", report
    assert report["after"] == "reply to /v1/after", report


SWAP = (
    "import os\n"
    "os.makedirs('victim/inner'); os.chmod('victim/inner', 0o755)\n"
    "open('victim/keep', 'w').write('x')\n"
    f"os.rename({AGENT_ROOT!r}, '/tmp/moved')\n"
    f"os.symlink(os.path.abspath('victim'), {AGENT_ROOT!r})\n"
    "print('swapped')\n"
)


async def test_a_link_put_in_place_of_the_agent_root_is_removed_not_followed(box: Box) -> None:
    """The agent moves its folders away and leaves a link to a folder of the workspace in
    their place. The cleanup (as the model's user) walked the link: it chmodded the folders
    it led to (0o700) and left the link. Now the link is removed, not followed."""
    run = await box.run(_launch(SWAP, files=[_file("agent.py", SWAP.encode())]))
    assert run.exit_code == 0 and run.transcript.strip() == "swapped", run
    check = (
        "import os; print(oct(os.stat('victim/inner').st_mode & 0o777), open('victim/keep').read())"
    )
    out = await box.sandbox.exec(["python3", "-c", check], timeout=20)
    assert out.stdout.split() == ["0o755", "x"], out


PUSH = (
    COMMON
    + r"""
size, count = int(sys.argv[2]), int(sys.argv[3])
socks, outcomes = [], []
for _ in range(count):
    s = socket.create_connection((url.hostname, url.port), timeout=20)
    try:
        s.sendall(b"x" * size)
        socks.append(s)
    except OSError:
        outcomes.append("reset")
for s in socks:
    s.settimeout(1.0)
    try:
        outcomes.append("reset" if s.recv(10) == b"" else "answered")
    except socket.timeout:
        outcomes.append("held")
    except OSError:
        outcomes.append("reset")
print(json.dumps({o: outcomes.count(o) for o in set(outcomes)}))
"""
)


async def test_what_a_stalled_gateway_leaves_queued_is_bounded_per_run(box: Box) -> None:
    """A gateway that takes no bytes (it never accepts): the agent's uploads queue in the
    server. Each connection was bounded (MAX_LINK_BUFFER), so MAX_LINKS of them held a GiB
    per agent; now all of a run's together are bounded (MAX_RUN_BUFFER): past it, the
    connection that pushes is reset."""
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(64)  # every connection is taken into the backlog, none accepted
    try:
        # Just under a link's bound each (the kernel's socket buffers take some of it), and
        # enough of them for well over the run's bound in all.
        per_link = MAX_LINK_BUFFER * 7 // 8
        count = 20
        argv = ["python3", f"{AGENT_DIR}/agent.py", GATEWAY_PLACEHOLDER, str(per_link), str(count)]
        gateway = f"http://127.0.0.1:{stalled.getsockname()[1]}"
        run = await box.run(_launch(PUSH, argv=argv, gateway=gateway))
    finally:
        stalled.close()
    assert run.exit_code == 0, run
    outcomes = json.loads(run.transcript)
    assert outcomes.get("reset", 0) >= 1, outcomes
    assert outcomes.get("held", 0) >= MAX_RUN_BUFFER // per_link, outcomes


LOUD = "import sys; sys.stdout.write('x' * int(sys.argv[1]))\n"


async def test_an_agent_that_prints_megabytes_still_gets_its_episode_graded(
    tmp_path: Path,
) -> None:
    """An agent that prints 2 MiB makes a reply frame over websockets' default 1 MiB: the
    client takes frames as big as the largest reply (MAX_FRAME_BYTES), so the episode is
    graded instead of lost (a lost one would be a failed rollout: a way for an agent that
    expects to lose to fail instead)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    bundle = load_bundle(ROOT / "bundles" / "shellcraft")
    provider = BwrapProvider(f"agent-adv-{uuid.uuid4().hex[:6]}", tmp_path / "state")
    launch = _launch(LOUD, argv=["python3", f"{AGENT_DIR}/agent.py", str(2 * 2**20)])
    with serve(build_app(bundle, sandbox=provider)) as url:
        async with EnvClient(url) as env:
            await env.reset(split="eval", index=0)
            result = await env.run_agent(launch)
    assert result.status == "graded" and len(result.run.transcript) == 2 * 2**20
