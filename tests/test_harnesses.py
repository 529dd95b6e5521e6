"""Harnesses: the launches they build, the CLIs' install folder, and each harness's launch run
for real on this machine.

The real runs materialize a launch the way the sandbox side does (:func:`materialize`): the
gateway placeholder becomes the gateway's origin, the files are written under the agent's
HOME and ``CORRAL_AGENT_DIR``, and the agent runs as the unprivileged user in a workspace with
exactly the launch's environment plus HOME, TMPDIR, PATH and CORRAL_AGENT_DIR. The folders are
in a scratch folder whose path replaces ``AGENT_ROOT`` in the launch (the real one, under /tmp,
is where tests/test_harness_rollouts.py runs the CLIs, inside sandboxes). The gateway is real,
in front of the scripted engine of ``tests/test_agent_clis.py`` (whose helpers these tests
import): one tool call that writes ``out.txt``, then a final text; so each run shows that the
launch's argv, environment and files make the agent call the tool and answer, and the sample
is checked token for token."""

from __future__ import annotations

import base64
import json
import os
import re
import tomllib
from pathlib import Path

import pytest

from corral.cli.harness import add_harness_command
from corral.cli.parsing import Parser
from corral.envs.agent_bridge import MAX_FILES_BYTES
from corral.envs.protocol import (
    AGENT_HOME,
    AGENT_ROOT,
    AGENT_TMP,
    GATEWAY_PLACEHOLDER,
    AgentLaunch,
)
from corral.harnesses import (
    HARNESSES,
    AgentTask,
    ClaudeCode,
    Codex,
    Command,
    Harness,
    HarnessError,
    SessionAccess,
    harness,
)
from corral.harnesses import clis as clis_mod
from corral.harnesses.clis import AgentClis, CliInstallError, find_clis, install_clis
from corral.harnesses.command import read_agent_dir
from tests import test_agent_clis as real
from tests.gateway_stack import ScriptedStack, scripted_gateway

ROOT = Path(__file__).resolve().parent.parent
TASK = AgentTask(prompt=real.PROMPT, instructions="Answer tersely.", task_id="task-7")
SESSION = SessionAccess(
    gateway="http://10.0.0.5:8000",
    session_path="/sessions/abc123",
    api_key="session-key-xyz",
    model="corral-test-model",
)
HOST_SECRET = "host-secret-do-not-leak-4711"

# The real CLIs and the unprivileged user, as tests/test_agent_clis.py finds and makes them.
claude = real.claude
codex = real.codex
agent = real.agent


def files_of(launch: AgentLaunch) -> dict[tuple[str, str], bytes]:
    return {(f.area, f.path): base64.b64decode(f.content_b64) for f in launch.files}


# -- the registry ------------------------------------------------------------------------------


def test_registry_names_and_errors() -> None:
    assert sorted(HARNESSES) == ["claude-code", "codex", "command"]
    assert all(cls.name == name for name, cls in HARNESSES.items())
    assert isinstance(harness("codex", max_retries=0), Codex)
    with pytest.raises(HarnessError, match="claude-code, codex, command"):
        harness("aider")
    with pytest.raises(HarnessError, match=r"unknown setting.*max_turn.*max_turns, max_retries"):
        harness("claude-code", max_turn=3)
    with pytest.raises(HarnessError, match=r"command.*missing.*command"):
        harness("command")
    with pytest.raises(HarnessError, match="non-empty"):
        harness("command", command="  ")
    with pytest.raises(HarnessError, match="max_turns must be >= 1"):
        ClaudeCode(max_turns=0)
    with pytest.raises(HarnessError, match="max_retries must be >= 0"):
        Codex(max_retries=-1)
    with pytest.raises(HarnessError, match="timeout_s must be > 0"):
        Codex().launch(TASK, SESSION, timeout_s=0)
    with pytest.raises(HarnessError, match="session_path"):
        SessionAccess(gateway="http://g", session_path="sessions/x/", api_key="k", model="m")


# -- the launches --------------------------------------------------------------------------------


def test_claude_code_launch() -> None:
    launch = ClaudeCode(max_turns=7, max_retries=0).launch(TASK, SESSION, timeout_s=120)
    assert launch.harness == "claude-code"
    assert launch.gateway == SESSION.gateway and launch.timeout_s == 120
    assert launch.transcript == "stdout"
    assert launch.argv == [
        "claude",
        "-p",
        TASK.prompt,
        "--output-format",
        "stream-json",
        "--verbose",
        "--permission-mode",
        "bypassPermissions",
        "--append-system-prompt",
        TASK.instructions,
        "--max-turns",
        "7",
    ]
    env = launch.env
    assert env["ANTHROPIC_BASE_URL"] == GATEWAY_PLACEHOLDER + "/sessions/abc123"
    assert env["ANTHROPIC_AUTH_TOKEN"] == SESSION.api_key
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_SMALL_FAST_MODEL"] == SESSION.model
    assert env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == SESSION.model
    for quiet in (
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
        "DISABLE_AUTOUPDATER",
        "DISABLE_TELEMETRY",
        "DISABLE_ERROR_REPORTING",
        "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK",
    ):
        assert env[quiet] == "1"
    assert env["CLAUDE_CODE_MAX_RETRIES"] == "0"
    assert "ANTHROPIC_API_KEY" not in env  # the auth token is the session's, as a bearer
    onboarding = json.loads(files_of(launch)[("home", ".claude.json")])
    assert onboarding["hasCompletedOnboarding"] is True

    # No instructions, no turn limit, the CLI's own retries: none of their flags or vars.
    plain = ClaudeCode().launch(
        AgentTask(prompt="p", instructions="", task_id="t"), SESSION, timeout_s=5
    )
    assert plain.argv[-2:] == ["--permission-mode", "bypassPermissions"]
    assert "CLAUDE_CODE_MAX_RETRIES" not in plain.env
    assert "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK" not in plain.env
    assert (
        ClaudeCode(max_retries=2).launch(TASK, SESSION, timeout_s=5).env["CLAUDE_CODE_MAX_RETRIES"]
        == "2"
    )


def test_codex_launch_and_config() -> None:
    launch = Codex(max_retries=0).launch(TASK, SESSION, timeout_s=60)
    assert launch.harness == "codex" and launch.gateway == SESSION.gateway
    assert launch.argv[:2] == ["codex", "exec"]
    for flag in (
        "--skip-git-repo-check",
        "--json",
        "--strict-config",
        "--dangerously-bypass-approvals-and-sandbox",
    ):
        assert flag in launch.argv
    # The prompt is the last argument, the bundle's instructions first in it.
    assert launch.argv[-1] == f"{TASK.instructions}\n\n{TASK.prompt}"
    assert launch.env["CODEX_HOME"] == f"{AGENT_HOME}/.codex"
    # Codex refuses a CODEX_HOME under the temporary folder: the sandbox's TMPDIR.
    assert not launch.env["CODEX_HOME"].startswith(AGENT_TMP + "/")
    config = tomllib.loads(files_of(launch)[("home", ".codex/config.toml")].decode())
    assert config["model"] == SESSION.model
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == GATEWAY_PLACEHOLDER + "/sessions/abc123/v1"
    assert provider["wire_api"] == "responses"
    assert launch.env[provider["env_key"]] == SESSION.api_key
    assert provider["request_max_retries"] == provider["stream_max_retries"] == 0
    assert config["check_for_update_on_startup"] is False
    assert config["web_search"] == "disabled"
    assert config["analytics"]["enabled"] is False
    assert config["feedback"]["enabled"] is False
    assert config["history"]["persistence"] == "none"
    assert config["otel"]["exporter"] == "none"
    assert config["features"]["plugins"] is False

    plain = Codex().launch(
        AgentTask(prompt="p", instructions="", task_id="t"), SESSION, timeout_s=5
    )
    assert plain.argv[-1] == "p"
    plain_config = tomllib.loads(files_of(plain)[("home", ".codex/config.toml")].decode())
    assert "request_max_retries" not in plain_config["model_providers"]["corral"]


def test_codex_config_survives_any_model_name() -> None:
    odd = 'we"ird\\mo\ndel ünï'
    session = SessionAccess(gateway="http://g:1", session_path="/s/1", api_key="k", model=odd)
    launch = Codex().launch(TASK, session, timeout_s=5)
    config = tomllib.loads(files_of(launch)[("home", ".codex/config.toml")].decode())
    assert config["model"] == odd


def test_command_launch() -> None:
    launch = Command(command="python3 $CORRAL_AGENT_DIR/a.py").launch(TASK, SESSION, timeout_s=9)
    assert launch.harness == "command" and launch.timeout_s == 9
    assert launch.argv == ["bash", "-c", "python3 $CORRAL_AGENT_DIR/a.py"]
    assert launch.env == {
        "OPENAI_BASE_URL": GATEWAY_PLACEHOLDER + "/sessions/abc123/v1",
        "OPENAI_API_KEY": SESSION.api_key,
        "ANTHROPIC_BASE_URL": GATEWAY_PLACEHOLDER + "/sessions/abc123",
        "ANTHROPIC_AUTH_TOKEN": SESSION.api_key,
        "CORRAL_MODEL": SESSION.model,
        "CORRAL_TASK_PROMPT": TASK.prompt,
        "CORRAL_INSTRUCTIONS": TASK.instructions,
        "CORRAL_TASK_ID": TASK.task_id,
    }
    assert launch.files == []


def test_no_host_secret_or_host_path_leaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CORRAL_ADMIN"):
        monkeypatch.setenv(var, HOST_SECRET)
    (tmp_path / "agent.py").write_text("print('hi')\n")
    built: list[Harness] = [
        ClaudeCode(),
        Codex(),
        Command(command="python3 $CORRAL_AGENT_DIR/agent.py", agent_dir=tmp_path),
    ]
    host_paths = {str(tmp_path), str(Path.home()), os.getcwd(), str(ROOT)}
    for h in built:
        launch = h.launch(TASK, SESSION, timeout_s=30)
        text = launch.model_dump_json() + "".join(
            files_of(launch)[k].decode() for k in files_of(launch)
        )
        assert HOST_SECRET not in text, h.name
        for path in host_paths:
            assert path not in text, (h.name, path)
        # The agent reaches the gateway through the placeholder, never at its real origin.
        assert SESSION.gateway not in text.replace(f'"gateway":"{SESSION.gateway}"', "")
        assert GATEWAY_PLACEHOLDER in text
        # Only paths inside the agent's own sandbox folders.
        for path in re.findall(r"(/[\w.-]+(?:/[\w.@-]+)+)", text):
            if path.startswith(("/sessions/", "/v1")):
                continue
            assert path.startswith(AGENT_ROOT), (h.name, path)


# -- agent_dir ---------------------------------------------------------------------------------


def test_agent_dir_is_shipped_with_its_layout(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "agent.py").write_text("import lib.util\n")
    (tmp_path / "lib" / "util.py").write_text("X = 1\n")
    run = tmp_path / "run.sh"
    run.write_text("#!/bin/sh\n")
    run.chmod(0o755)
    (tmp_path / "alias.py").symlink_to("agent.py")  # inside the folder: shipped as a copy
    (tmp_path / "empty").mkdir()
    launch = Command(command="./run.sh", agent_dir=tmp_path).launch(TASK, SESSION, timeout_s=5)
    assert {f.area for f in launch.files} == {"agent_dir"}
    assert files_of(launch) == {
        ("agent_dir", "agent.py"): b"import lib.util\n",
        ("agent_dir", "alias.py"): b"import lib.util\n",
        ("agent_dir", "lib/util.py"): b"X = 1\n",
        ("agent_dir", "run.sh"): b"#!/bin/sh\n",
    }
    assert {f.path for f in launch.files if f.executable} == {"run.sh"}
    # Read once, when made: a later change is not shipped.
    (tmp_path / "late.py").write_text("")
    h = harness("command", command="x", agent_dir=str(tmp_path))
    assert isinstance(h, Command) and ("agent_dir", "late.py") in files_of(
        h.launch(TASK, SESSION, timeout_s=1)
    )


def test_agent_dir_refusals(tmp_path: Path) -> None:
    outside = tmp_path / "secret.txt"
    outside.write_text("host secret\n")
    with pytest.raises(HarnessError, match="not a folder"):
        Command(command="x", agent_dir=tmp_path / "missing")

    escaping = tmp_path / "escaping"
    escaping.mkdir()
    (escaping / "s").symlink_to(outside)
    with pytest.raises(HarnessError, match="symlink s leads out"):
        Command(command="x", agent_dir=escaping)

    dotdot = tmp_path / "dotdot"
    (dotdot / "sub").mkdir(parents=True)
    (dotdot / "sub" / "up").symlink_to("../../secret.txt")
    with pytest.raises(HarnessError, match="sub/up leads out"):
        Command(command="x", agent_dir=dotdot)

    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "d").symlink_to(tmp_path)
    with pytest.raises(HarnessError, match="symlink to a folder"):
        Command(command="x", agent_dir=linked)

    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "pipe")
    with pytest.raises(HarnessError, match="pipe is not a regular file"):
        Command(command="x", agent_dir=fifo)

    big = tmp_path / "big"
    big.mkdir()
    (big / "a").write_bytes(b"x" * 10)
    with (big / "b").open("wb") as f:  # sparse: 32 MiB + 1 byte without writing them
        f.truncate(MAX_FILES_BYTES - 9)
    with pytest.raises(HarnessError, match="more than 32 MiB"):
        Command(command="x", agent_dir=big)
    assert len(read_agent_dir(big, max_bytes=MAX_FILES_BYTES + 1)) == 2


# -- transcripts -------------------------------------------------------------------------------


def test_summaries_survive_garbage() -> None:
    garbage = '\x00\x01not json\n{"type": "assistant", "message": 3}\n[1,2]\n{"type":\n\n'
    for h in (ClaudeCode(), Codex(), Command(command="x")):
        summary = h.summarize_transcript(garbage)
        assert summary.tool_uses == 0
        assert h.summarize_transcript("").events == 0
    claude_summary = ClaudeCode().summarize_transcript(garbage)
    assert (claude_summary.events, claude_summary.unparsed_lines) == (1, 3)
    assert Command(command="x").summarize_transcript("a\nlast line\n\n").final_text == "last line"


def test_summaries_of_well_formed_transcripts() -> None:
    claude_lines = [
        {"type": "system", "subtype": "init"},
        {"type": "assistant", "message": {"content": [{"type": "tool_use", "name": "Bash"}]}},
        {"type": "user", "message": {"content": [{"type": "tool_result"}]}},
        {"type": "assistant", "message": {"content": [{"type": "text", "text": "Done."}]}},
        {"type": "result", "subtype": "success", "is_error": False, "result": "Done."},
    ]
    s = ClaudeCode().summarize_transcript("\n".join(json.dumps(x) for x in claude_lines) + "\n")
    assert (s.events, s.tool_uses, s.final_text, s.errors) == (5, 1, "Done.", 0)
    failed = ClaudeCode().summarize_transcript(
        json.dumps({"type": "result", "is_error": True, "result": "API Error: 500"})
    )
    assert failed.errors == 1

    codex_lines = [
        {"type": "thread.started"},
        {"type": "item.completed", "item": {"type": "error", "message": "metadata not found"}},
        {"type": "item.completed", "item": {"type": "command_execution", "exit_code": 0}},
        {"type": "item.completed", "item": {"type": "agent_message", "text": "Done."}},
        {"type": "turn.failed", "error": {"message": "stream disconnected"}},
    ]
    s = Codex().summarize_transcript("\n".join(json.dumps(x) for x in codex_lines))
    assert (s.events, s.tool_uses, s.final_text, s.errors) == (5, 1, "Done.", 1)


# -- the CLIs' folder --------------------------------------------------------------------------


def _elf(path: Path, *, native: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF\x02\x01\x01" if native else b"#!/usr/bin/env node\n")
    path.chmod(0o755)
    return path


def _package(folder: Path, name: str, version: str) -> None:
    pkg = folder / "node_modules" / name / "package.json"
    pkg.parent.mkdir(parents=True, exist_ok=True)
    pkg.write_text(json.dumps({"name": name, "version": version}))


def _fake_install(folder: Path) -> AgentClis:
    """The npm layout of the pinned versions, with stand-in ELF files for the binaries."""
    _package(folder, clis_mod.CLAUDE_CODE_PACKAGE, clis_mod.CLAUDE_CODE_VERSION)
    _package(folder, clis_mod.CODEX_PACKAGE, clis_mod.CODEX_VERSION)
    claude = _elf(folder / "node_modules/@anthropic-ai/claude-code/bin/claude.exe")
    codex = _elf(
        folder / "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
    )
    return AgentClis(claude=claude, codex=codex)


def test_find_clis_on_a_fake_npm_layout(tmp_path: Path) -> None:
    assert find_clis(tmp_path / "nothing") == AgentClis(None, None)
    # Only node wrappers: not native, not found.
    _elf(tmp_path / "node_modules/@anthropic-ai/claude-code/bin/claude", native=False)
    _elf(tmp_path / "node_modules/@openai/codex/bin/codex.js", native=False)
    assert find_clis(tmp_path) == AgentClis(None, None)
    # An older Claude Code layout (per-platform package), Codex nested under its package.
    old = _elf(tmp_path / "node_modules/@anthropic-ai/claude-code-linux-x64/claude")
    nested = _elf(
        tmp_path / "node_modules/@openai/codex/node_modules/@openai/codex-linux-x64/vendor/"
        "x86_64-unknown-linux-musl/bin/codex"
    )
    assert find_clis(tmp_path) == AgentClis(claude=old, codex=nested)
    assert not clis_mod.up_to_date(tmp_path)  # no package.json versions
    # The current layout wins over the older one.
    current = _fake_install(tmp_path)
    assert current != AgentClis(claude=old, codex=nested)
    assert find_clis(tmp_path) == current
    assert clis_mod.up_to_date(tmp_path)
    _package(tmp_path, clis_mod.CODEX_PACKAGE, "0.1.0")
    assert not clis_mod.up_to_date(tmp_path)


def test_find_clis_on_the_real_install() -> None:
    folder = real.CLIS_DIR
    if not (folder / "node_modules").is_dir():
        pytest.skip(f"no agent CLIs installed in {folder}")
    found = find_clis(folder)
    assert found.claude is not None and clis_mod.is_native(found.claude)
    assert found.codex is not None and clis_mod.is_native(found.codex)
    assert clis_mod.installed_version(folder, clis_mod.CLAUDE_CODE_PACKAGE) == (
        clis_mod.CLAUDE_CODE_VERSION
    )
    assert clis_mod.installed_version(folder, clis_mod.CODEX_PACKAGE) == clis_mod.CODEX_VERSION


def test_pinned_versions_match_the_ci_script() -> None:
    script = (ROOT / "scripts" / "agent_clis.sh").read_text()
    assert f'CLAUDE_CODE_VERSION="${{CLAUDE_CODE_VERSION:-{clis_mod.CLAUDE_CODE_VERSION}}}"' in (
        script
    )
    assert f'CODEX_VERSION="${{CODEX_VERSION:-{clis_mod.CODEX_VERSION}}}"' in script


def test_default_clis_dir() -> None:
    assert clis_mod.default_clis_dir({"CORRAL_AGENT_CLIS": "/opt/x"}) == Path("/opt/x")
    home = Path("~").expanduser()
    assert clis_mod.default_clis_dir({}) == home / ".cache/corral/agent-clis"
    assert clis_mod.default_clis_dir({"CORRAL_AGENT_CLIS": ""}) == home / ".cache/corral/agent-clis"


def _npm(tmp_path: Path, body: str) -> str:
    """A stand-in ``npm`` (the real one needs the npm registry): a script running ``body``
    with npm's argv as "$@", logging it to npm.log."""
    npm = tmp_path / "bin" / "npm"
    npm.parent.mkdir(parents=True, exist_ok=True)
    npm.write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/npm.log\n{body}\n')
    npm.chmod(0o755)
    return str(npm)


def test_install_clis(tmp_path: Path) -> None:
    lines: list[str] = []
    with pytest.raises(CliInstallError, match=r"npm .* is not on PATH"):
        install_clis(tmp_path / "a", npm=str(tmp_path / "no-npm"))
    failing = _npm(tmp_path, "exit 3")
    with pytest.raises(CliInstallError, match="exit 3"):
        install_clis(tmp_path / "b", npm=failing)
    empty = _npm(tmp_path, "exit 0")
    with pytest.raises(CliInstallError, match="no native"):
        install_clis(tmp_path / "c", npm=empty)

    # A stand-in npm that lays out the packages as the real one does.
    fake = tmp_path / "layout"
    _fake_install(fake)
    folder = tmp_path / "d"
    good = _npm(tmp_path, f'cp -r {fake}/node_modules "$3"/')
    found = install_clis(folder, npm=good, progress=lines.append)
    assert found == find_clis(folder) and found.claude is not None and found.codex is not None
    log = (tmp_path / "npm.log").read_text().splitlines()
    assert log[-1] == (
        f"install --prefix {folder} --no-audit --no-fund "
        f"@anthropic-ai/claude-code@{clis_mod.CLAUDE_CODE_VERSION} "
        f"@openai/codex@{clis_mod.CODEX_VERSION}"
    )
    assert lines[0].startswith("installing") and lines[-1].startswith("agent CLIs installed")
    # Up to date: npm is not run again (even a missing npm is fine), unless forced.
    assert install_clis(folder, npm=str(tmp_path / "no-npm"), progress=lines.append) == found
    assert "already installed" in lines[-1]
    install_clis(folder, npm=good, force=True)
    assert len((tmp_path / "npm.log").read_text().splitlines()) == len(log) + 1


def test_harness_list_and_install_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = Parser(prog="corral")
    add_harness_command(parser.add_subparsers(dest="command", required=True))
    fake = _fake_install(tmp_path / "clis")
    args = parser.parse_args(["harness", "list", "--clis", str(tmp_path / "clis")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for name in HARNESSES:
        assert f"{name}: " in out
    assert f"claude: {fake.claude}" in out and f"codex: {fake.codex}" in out
    assert "needs no agent CLI" in out

    args = parser.parse_args(["harness", "list", "--clis", str(tmp_path / "none")])
    args.func(args)
    assert out.count("not installed") == 0
    assert capsys.readouterr().out.count("not installed in") == 2

    args = parser.parse_args(["harness", "install", str(tmp_path / "clis")])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"claude={fake.claude}", f"codex={fake.codex}"]
    assert "already installed" in captured.err


# -- the real runs -------------------------------------------------------------------------------


@pytest.fixture
def agent_root(agent: real.Agent) -> Path:
    """The agent's folders (home, tmp, agent) in the scratch folder: the launch's
    ``AGENT_ROOT`` paths are rewritten to it (never the host's own ``AGENT_ROOT``, which a
    local-backend agent of another test may need, and a killed test would leave behind)."""
    root = agent.home.parent / "agent-root"
    root.mkdir()
    return root


def materialize(
    launch: AgentLaunch, *, origin: str, root: Path, agent: real.Agent, clis: dict[str, Path]
) -> list[str]:
    """What the sandbox side does with ``launch``, on the host: its files written (HOME's
    owned by the agent, CORRAL_AGENT_DIR's read-only), the placeholder replaced by
    ``origin``, the agent's four variables set; ``clis`` linked by name first on PATH.
    Returns the command line that runs it as the agent user with exactly that environment."""

    def sub(text: str) -> str:
        return text.replace(GATEWAY_PLACEHOLDER, origin).replace(AGENT_ROOT, str(root))

    home, tmp, agent_dir, bin_dir = root / "home", root / "tmp", root / "agent", root / "bin"
    for folder in (home, tmp, agent_dir, bin_dir):
        folder.mkdir(exist_ok=True)
    for name, path in clis.items():
        (bin_dir / name).symlink_to(path)
    for f in launch.files:
        base = home if f.area == "home" else agent_dir
        path = base / f.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(sub(base64.b64decode(f.content_b64).decode()))
        path.chmod(0o755 if f.executable else 0o644)
    for folder in (home, tmp):
        for dirpath, _dirs, names in os.walk(folder):
            for name in [".", *names]:
                os.chown(Path(dirpath) / name, agent.uid, agent.gid)
    for dirpath, _dirs, names in os.walk(agent_dir):
        Path(dirpath).chmod(0o555)
        for name in names:
            (Path(dirpath) / name).chmod(
                0o555 if os.access(Path(dirpath) / name, os.X_OK) else 0o444
            )
    env = {
        **{k: sub(v) for k, v in launch.env.items()},
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "PATH": f"{bin_dir}:{real.PATH}",
        "CORRAL_AGENT_DIR": str(agent_dir),
    }
    pairs = [f"{k}={v}" for k, v in {"LANG": "C.UTF-8", **real.NO_NETWORK, **env}.items()]
    prefix = [] if agent.user is None else ["runuser", "-u", agent.user, "--"]
    return [*prefix, "env", "-i", *pairs, *(sub(a) for a in launch.argv)]


def _session(stack: ScriptedStack, model: str) -> tuple[SessionAccess, dict[str, str]]:
    session = stack.session()
    access = SessionAccess(
        gateway=stack.url,
        session_path=f"/sessions/{session['id']}",
        api_key=session["api_key"],
        model=model,
    )
    # The paths the gateway hands out are the ones the harness builds from session_path.
    assert GATEWAY_PLACEHOLDER + access.session_path == GATEWAY_PLACEHOLDER + session[
        "anthropic_base_url"
    ].removeprefix(stack.url)
    return access, session


def test_claude_code_harness_runs_for_real(
    claude: Path, agent: real.Agent, agent_root: Path, tiny_model_dir: Path
) -> None:
    with scripted_gateway(tiny_model_dir, model_name=real.MODEL, context=real.CONTEXT) as stack:
        access, session = _session(stack, real.MODEL)
        stack.engine.push(
            stack.tool_call("Bash", {"command": "echo hi > out.txt"}), stack.ids(real.FINAL_TEXT)
        )
        h = harness("claude-code", max_retries=0)
        launch = h.launch(TASK, access, timeout_s=real.CLI_TIMEOUT_S)
        argv = materialize(
            launch, origin=stack.url, root=agent_root, agent=agent, clis={"claude": claude}
        )
        run = real._run(argv, agent.work, timeout=launch.timeout_s)
        with real.explained(stack, session, run):
            assert run.returncode == 0
            assert (agent.work / "out.txt").read_text() == "hi\n"
            summary = h.summarize_transcript(run.stdout)
            assert summary.final_text == real.FINAL_TEXT
            assert (summary.tool_uses, summary.errors, summary.unparsed_lines) == (1, 0, 0)
            calls = stack.engine.requests
            assert len(calls) == 2 and stack.engine.pending == 0
            # --append-system-prompt reached the model.
            assert TASK.instructions in stack.tokenizer.decode(calls[0].input_ids)
            real._check_one_exact_sample(stack, session, "(Bash completed with no output)")


def test_codex_harness_runs_for_real(
    codex: Path, agent: real.Agent, agent_root: Path, tiny_model_dir: Path
) -> None:
    with scripted_gateway(tiny_model_dir, model_name=real.MODEL, context=real.CONTEXT) as stack:
        access, session = _session(stack, real.MODEL)
        stack.engine.push(
            stack.tool_call("exec_command", {"cmd": "echo hi > out.txt"}),
            stack.ids(real.FINAL_TEXT),
        )
        h = harness("codex", max_retries=0)
        launch = h.launch(TASK, access, timeout_s=real.CLI_TIMEOUT_S)
        argv = materialize(
            launch, origin=stack.url, root=agent_root, agent=agent, clis={"codex": codex}
        )
        run = real._run(argv, agent.work, timeout=launch.timeout_s)
        with real.explained(stack, session, run):
            assert run.returncode == 0
            assert (agent.work / "out.txt").read_text() == "hi\n"
            summary = h.summarize_transcript(run.stdout)
            assert summary.final_text == real.FINAL_TEXT
            assert (summary.tool_uses, summary.errors, summary.unparsed_lines) == (1, 0, 0)
            calls = stack.engine.requests
            assert len(calls) == 2 and stack.engine.pending == 0
            first = stack.tokenizer.decode(calls[0].input_ids)
            assert f"{TASK.instructions}\n\n{TASK.prompt}" in first
            real._check_one_exact_sample(stack, session, "Process exited with code 0")


# A stdlib-only agent on OpenAI Chat Completions: it runs the model's shell calls itself.
AGENT_PY = """\
import json, os, subprocess, urllib.request

print(json.dumps({"task": os.environ["CORRAL_TASK_ID"]}), flush=True)
tools = [{"type": "function", "function": {"name": "shell", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]
messages = [{"role": "system", "content": os.environ["CORRAL_INSTRUCTIONS"]},
            {"role": "user", "content": os.environ["CORRAL_TASK_PROMPT"]}]
while True:
    body = {"model": os.environ["CORRAL_MODEL"], "messages": messages, "tools": tools}
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        msg = json.load(r)["choices"][0]["message"]
    messages.append({k: msg[k] for k in ("role", "content", "tool_calls") if msg.get(k)})
    if not msg.get("tool_calls"):
        print(json.dumps({"final": msg["content"]}))
        break
    for call in msg["tool_calls"]:
        command = json.loads(call["function"]["arguments"])["command"]
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
        print(json.dumps({"tool": command}), flush=True)
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": done.stdout or "(no output)"})
"""


def test_command_harness_runs_for_real(
    agent: real.Agent, agent_root: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "agent.py").write_text(AGENT_PY)
    with scripted_gateway(tiny_model_dir, model_name=real.MODEL, context=real.CONTEXT) as stack:
        access, session = _session(stack, real.MODEL)
        stack.engine.push(
            stack.tool_call("shell", {"command": "echo hi > out.txt"}), stack.ids(real.FINAL_TEXT)
        )
        h = harness("command", command='python3 "$CORRAL_AGENT_DIR/agent.py"', agent_dir=tmp_path)
        launch = h.launch(TASK, access, timeout_s=60)
        argv = materialize(launch, origin=stack.url, root=agent_root, agent=agent, clis={})
        run = real._run(argv, agent.work, timeout=launch.timeout_s)
        with real.explained(stack, session, run):
            assert run.returncode == 0
            assert (agent.work / "out.txt").read_text() == "hi\n"
            lines = [json.loads(line) for line in run.stdout.splitlines()]
            assert lines == [
                {"task": TASK.task_id},
                {"tool": "echo hi > out.txt"},
                {"final": real.FINAL_TEXT},
            ]
            assert h.summarize_transcript(run.stdout).final_text == json.dumps(
                {"final": real.FINAL_TEXT}
            )
            assert TASK.instructions in stack.tokenizer.decode(stack.engine.requests[0].input_ids)
            real._check_one_exact_sample(stack, session, "(no output)")
