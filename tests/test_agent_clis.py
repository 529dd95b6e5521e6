"""The real agent CLIs through the gateway: Claude Code (Anthropic Messages) and Codex
(OpenAI Responses), each run headless as an unprivileged user against a gateway session.

The gateway renders with the tiny test model's tokenizer (Qwen 2.5 template) and sits in front
of the scripted test engine (``tests/scripted_engine.py``), which answers with token ids chosen
here: first one shell tool call that writes ``out.txt``, then a short final text. So each CLI
really runs the tool, sends its result back, and prints the answer; and what the gateway
recorded can be checked token for token against what the engine received and produced: one
sample for the conversation, mask 1 exactly on the engine's tokens, the tool's result inside
it with mask 0, the engine's logprobs.

The CLIs come from ``scripts/agent_clis.sh`` (pinned versions; CI installs them into
``$CORRAL_AGENT_CLIS``, default ``/var/cache/corral-agent-clis``); the tests skip only when they
are not installed. Every setting that makes a CLI talk to anything but the gateway (telemetry,
update checks, analytics, plugins) is off, and their retries are 0, so that a gateway error
fails the run at once; each run is bounded by :data:`CLI_TIMEOUT_S`. Behind those settings,
HTTP(S) proxies point at a dead loopback port (only loopback is exempt), so that nothing a CLI
might still try can leave the machine.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.gateway_stack import ScriptedStack, scripted_gateway

ROOT = Path(__file__).resolve().parent.parent
CLIS_DIR = Path(os.environ.get("CORRAL_AGENT_CLIS", "/var/cache/corral-agent-clis"))
AGENT_USER = "corral-agent"  # scripts/agent_clis.sh --user's default
MODEL = "corral-test-model"
# Claude Code's first request is ~52 KB of JSON, ~30k tokens rendered with the tiny tokenizer.
CONTEXT = 262_144
CLI_TIMEOUT_S = 180
PROMPT = "create out.txt containing hi"
FINAL_TEXT = "Done."
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A second fence behind the CLIs' own settings: any HTTP(S) request to anything but loopback
# goes to a proxy that does not exist (port 9, discard) and fails, instead of leaving the box.
_DEAD_PROXY = "http://127.0.0.1:9"
NO_NETWORK = {
    **{k: _DEAD_PROXY for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")},
    **{k.lower(): _DEAD_PROXY for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")},
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


# -- the CLIs --------------------------------------------------------------------------------


def _native(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _find(patterns: list[str]) -> Path | None:
    """The first native executable matching one of ``patterns`` (globs under CLIS_DIR), as
    ``scripts/agent_clis.sh`` finds them."""
    for pattern in patterns:
        for candidate in sorted(CLIS_DIR.glob(pattern)):
            if candidate.is_file() and os.access(candidate, os.X_OK) and _native(candidate):
                return candidate
    return None


@pytest.fixture
def claude() -> Path:
    """Claude Code's native binary (a skip when it is not installed)."""
    found = _find(
        [
            "node_modules/@anthropic-ai/claude-code/bin/claude.exe",
            "node_modules/@anthropic-ai/claude-code/bin/claude",
            "node_modules/@anthropic-ai/claude-code-linux-*/claude",
            "node_modules/@anthropic-ai/claude-code/node_modules/@anthropic-ai/claude-code-linux-*/claude",
        ]
    )
    if found is None:
        pytest.skip(
            f"Claude Code is not installed in {CLIS_DIR} "
            f"(bash scripts/agent_clis.sh {CLIS_DIR}; CORRAL_AGENT_CLIS names the folder)"
        )
    return found


@pytest.fixture
def codex() -> Path:
    """Codex's native binary (a skip when it is not installed)."""
    found = _find(
        [
            "node_modules/@openai/codex-linux-*/vendor/*/bin/codex",
            "node_modules/@openai/codex/node_modules/@openai/codex-linux-*/vendor/*/bin/codex",
            "node_modules/@openai/codex/vendor/*/bin/codex",
        ]
    )
    if found is None:
        pytest.skip(
            f"Codex is not installed in {CLIS_DIR} "
            f"(bash scripts/agent_clis.sh {CLIS_DIR}; CORRAL_AGENT_CLIS names the folder)"
        )
    return found


@dataclass
class Agent:
    """Who runs a CLI: the unprivileged user when the tests run as root (Claude Code refuses
    ``bypassPermissions`` as root), else the current user; and a scratch folder of theirs."""

    user: str | None  # None: the current (non-root) user
    uid: int
    gid: int
    home: Path  # a fresh HOME (and CODEX_HOME inside it), outside /tmp
    work: Path  # the CLI's working directory

    def command(self, env: dict[str, str], argv: list[str]) -> list[str]:
        """``argv`` as the agent user, with exactly ``env`` (nothing of ours leaks through)."""
        base = {"PATH": PATH, "HOME": str(self.home), "LANG": "C.UTF-8", **NO_NETWORK}
        pairs = [f"{k}={v}" for k, v in {**base, **env}.items()]
        prefix = [] if self.user is None else ["runuser", "-u", self.user, "--"]
        return [*prefix, "env", "-i", *pairs, *argv]


@pytest.fixture
def agent(request: pytest.FixtureRequest) -> Iterator[Agent]:
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser: cannot run the CLIs unprivileged")
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "agent_clis.sh"), "--user", AGENT_USER],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        user: str | None = proc.stdout.strip()
        entry = pwd.getpwnam(AGENT_USER)
    else:
        user = None
        entry = pwd.getpwuid(os.getuid())
    # Under the user's home, not /tmp: Codex refuses a CODEX_HOME under a temporary folder
    # (then its sandbox cannot start); and pytest's tmp_path is root's, mode 0700.
    parent = Path(entry.pw_dir) / ".corral-tests"
    parent.mkdir(mode=0o755, exist_ok=True)
    os.chown(parent, entry.pw_uid, entry.pw_gid)
    scratch = Path(tempfile.mkdtemp(prefix=request.node.name[:40] + "-", dir=parent))
    home, work = scratch / "home", scratch / "work"
    for folder in (scratch, home, work):
        folder.mkdir(exist_ok=True)
        os.chown(folder, entry.pw_uid, entry.pw_gid)
    try:
        yield Agent(user=user, uid=entry.pw_uid, gid=entry.pw_gid, home=home, work=work)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@dataclass
class Run:
    argv: list[str]
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (
            f"$ {' '.join(self.argv)}\nexit: {self.returncode}\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr[-20000:]}"
        )


def _run(argv: list[str], cwd: Path, timeout: float = CLI_TIMEOUT_S) -> Run:
    """Run ``argv`` in a process group of its own; at the timeout the whole group is killed."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return Run(argv, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Run(argv, None, out, err + f"\n[killed after {timeout} s]")


# -- the gateway in front of the scripted engine ----------------------------------------------


@contextmanager
def explained(stack: ScriptedStack, session: dict[str, Any], run: Run) -> Iterator[None]:
    """On a failed assertion: print the CLI's run, what the engine got, the session's view."""
    try:
        yield
    except BaseException:
        print(run.describe())
        print("--- engine requests ---")
        for i, r in enumerate(stack.engine.requests):
            print(
                f"#{i}: {len(r.input_ids)} input ids, stream {r.stream}, status {r.status}, "
                f"finish {r.finish_reason}, output {r.output_ids}"
            )
        print("--- gateway session view (turns without their messages) ---")
        try:
            view = stack.view(session["id"])
        except Exception as exc:  # the gateway itself may be what broke
            print(f"(no view: {exc!r})")
            raise
        turns = [
            {**t, "messages": [m.get("role") for m in t.get("messages") or []]}
            for t in view.get("turns", [])
        ]
        print(json.dumps({**view, "turns": turns}, indent=1))
        raise


def _check_one_exact_sample(
    stack: ScriptedStack, session: dict[str, Any], tool_output: str
) -> None:
    """The session holds one sample: the engine's last input + output, mask 1 exactly on the
    engine's tokens, its logprobs; the tool's output text lies between the answers, mask 0."""
    calls = stack.engine.requests
    samples = stack.samples(session["id"])
    assert len(samples) == 1, stack.view(session["id"])["drift"]
    (sample,) = samples
    tokens = sample["tokens"]
    last = calls[-1]
    assert tokens == last.input_ids + last.output_ids
    prompt_len = len(calls[0].input_ids)
    assert sample["response_length"] == len(tokens) - prompt_len
    mask = [0] * len(tokens)
    logprobs = [0.0] * len(tokens)
    for call in calls:
        start = len(call.input_ids)
        assert tokens[: start + len(call.output_ids)] == call.input_ids + call.output_ids
        assert len(call.logprobs) == len(call.output_ids)
        for k, lp in enumerate(call.logprobs):
            mask[start + k] = 1
            logprobs[start + k] = lp
    assert sample["loss_mask"] == mask[prompt_len:]
    assert sample["rollout_log_probs"] == pytest.approx(logprobs[prompt_len:], abs=1e-6)
    assert sample["metadata"]["num_turns"] == len(calls)
    assert sample["metadata"]["label"] is None  # the agent's own conversation, not "side"
    assert sample["status"] == "completed"
    assert stack.view(session["id"])["drift"]["forks"] == 0
    # What the client sent back between the two answers (the tool's result, rendered by the
    # template) is in the sample, and never trained on.
    first = calls[0]
    between = tokens[len(first.input_ids) + len(first.output_ids) : len(last.input_ids)]
    assert tool_output in stack.tokenizer.decode(between)
    assert set(mask[len(first.input_ids) + len(first.output_ids) : len(last.input_ids)]) == {0}


# -- Claude Code -----------------------------------------------------------------------------


# ``claude``/``codex`` come before ``agent``: a missing CLI skips before the user is created.
def test_claude_code_runs_a_tool_and_yields_one_exact_sample(
    claude: Path, agent: Agent, tiny_model_dir: Path
) -> None:
    with scripted_gateway(tiny_model_dir, model_name=MODEL, context=CONTEXT) as stack:
        session = stack.session()
        stack.engine.push(
            stack.tool_call("Bash", {"command": "echo hi > out.txt"}), stack.ids(FINAL_TEXT)
        )
        env = {
            "ANTHROPIC_BASE_URL": session["anthropic_base_url"],
            "ANTHROPIC_AUTH_TOKEN": session["api_key"],
            "ANTHROPIC_MODEL": MODEL,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            # No retries, and no non-streaming retry of a failed stream (Claude Code's
            # fallback, which CLAUDE_CODE_MAX_RETRIES=0 does not stop).
            "CLAUDE_CODE_MAX_RETRIES": "0",
            "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1",
        }
        argv = [str(claude), "-p", PROMPT, "--permission-mode", "bypassPermissions"]
        run = _run(agent.command(env, argv), agent.work)
        with explained(stack, session, run):
            assert run.returncode == 0
            assert "API Error" not in run.stdout + run.stderr
            assert FINAL_TEXT in run.stdout
            assert (agent.work / "out.txt").read_text() == "hi\n"
            # Two requests: the tool call, then the answer after its result. Nothing else goes
            # to the model in -p mode with nonessential traffic off (no titles, no summaries).
            calls = stack.engine.requests
            assert len(calls) == 2
            assert all(c.stream and c.status == 200 for c in calls)
            assert stack.engine.pending == 0
            _check_one_exact_sample(stack, session, "(Bash completed with no output)")


# -- Codex -----------------------------------------------------------------------------------


def _codex_config(base_url: str) -> str:
    """Codex's config.toml: the gateway session as its only provider, everything else that
    talks to the network off, no retries (see scripts/agent_clis.sh)."""
    return f"""\
model = "{MODEL}"
model_provider = "corral"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[history]
persistence = "none"

[otel]
exporter = "none"

[features]
plugins = false

[model_providers.corral]
name = "corral"
base_url = {json.dumps(base_url)}
env_key = "CORRAL_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""


def test_codex_runs_a_tool_and_yields_one_exact_sample(
    codex: Path, agent: Agent, tiny_model_dir: Path
) -> None:
    with scripted_gateway(tiny_model_dir, model_name=MODEL, context=CONTEXT) as stack:
        session = stack.session()
        stack.engine.push(
            stack.tool_call("exec_command", {"cmd": "echo hi > out.txt"}), stack.ids(FINAL_TEXT)
        )
        codex_home = agent.home / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(_codex_config(session["base_url"]))
        for path in (codex_home, codex_home / "config.toml"):
            os.chown(path, agent.uid, agent.gid)
        env = {"CODEX_HOME": str(codex_home), "CORRAL_API_KEY": session["api_key"]}
        argv = [
            str(codex),
            "exec",
            "--skip-git-repo-check",
            "--strict-config",
            "--sandbox",
            "workspace-write",
            PROMPT,
        ]
        run = _run(agent.command(env, argv), agent.work)
        with explained(stack, session, run):
            assert run.returncode == 0
            assert "ERROR" not in run.stderr  # how Codex reports a failed request
            assert FINAL_TEXT in run.stdout  # the final answer; the transcript is on stderr
            assert (agent.work / "out.txt").read_text() == "hi\n"
            # Two requests: the exec_command call, then the answer after its output.
            calls = stack.engine.requests
            assert len(calls) == 2
            assert all(c.stream and c.status == 200 for c in calls)
            assert stack.engine.pending == 0
            _check_one_exact_sample(stack, session, "Process exited with code 0")
