"""corral's overhead per harness rollout: a black-box agent in the episode's sandbox against the
built-in episode player, on the same shellcraft rows.

Run: ``python bench/harness.py [--rows 8] [--backends bwrap docker local] [--no-clis]``
(docker needs ``DOCKER_HOST`` and the sandbox image; a backend that cannot run here is
skipped, saying why).

Everything runs here, in one process: the scripted test engine (tests/scripted_engine.py: no
model, fixed tokens) behind a real gateway with an admin token, and one shellcraft env server
per backend that lets agents reach that gateway. The engine plays one fixed 2-turn episode to
whoever asks: a ``bash`` tool call (``ls``) while the conversation has no tool result, then a
plain answer (``submit`` for the player, whose episode ends on it). Per backend, on the same
``--rows`` eval rows, one at a time:

- **player**: :class:`corral.rollouts.player.Player` plays the row through the gateway (two
  model calls, the ``bash`` and ``submit`` steps on the env server, the grade): the
  baseline, measured in the same run;
- **harness**: the ``command`` harness runs a tiny standard-library agent (:data:`AGENT`) in
  the episode's sandbox through :class:`corral.rollouts.harness_play.HarnessPlayer`: the same
  two model requests (through the agent's bridged listener), the ``ls`` run by the agent
  itself, then it exits and the env server grades the folder.

Per harness rollout (p50 over the rows): *to launch* (the rollout's start to the agent frame
sent: the session and the reset, with the episode's sandbox), *agent start* (the env server
taking the launch to the agent's process started: the launcher), *start -> first request*
(the rollout's start to the agent's first gateway connection: all of the above and the
agent's interpreter start), *agent* (the agent's own run time, from its first line to its
exit, as it reports it), *its model calls* (inside *agent*: two requests through the bridge),
*exit -> reward* (the end of the run as the env server records it, the launcher and all it
started gone, to the reward set on the session: the finish tool, the grade, the outcome, the
samples), the *total*,
and **corral's overhead**: total minus the agent's own run time, with its ratio to the
built-in player's total on the same backend. Target: corral's overhead per harness rollout
under 1 s on bwrap.

When the agent CLIs are installed (``scripts/agent_clis.sh``; ``CORRAL_AGENT_CLIS`` or
``/var/cache/corral-agent-clis``), the CLIs' own start-up is measured apart ("theirs"): the
agent's process start to its first gateway request, Claude Code and Codex CLI through their
harnesses on each backend that runs agents (the engine answers them with plain text, so they
exit after their first answer).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the scripted engine lives with the tests

SHELLCRAFT = ROOT / "bundles" / "shellcraft"
ADMIN = "bench-admin-token"
MODEL = "corral"
AGENT_TIMEOUT_S = 60.0
CLI_TIMEOUT_S = 60.0
BACKENDS = ("bwrap", "docker", "local")
CLIS_DIR = Path(os.environ.get("CORRAL_AGENT_CLIS", "/var/cache/corral-agent-clis"))

# The tiny agent: two chat-completions requests with a `bash` tool, the tool call run here.
# Prints "AGENT_S <its run time> MODEL_S <its model calls' time>" last.
AGENT = r"""
import json, os, subprocess, time, urllib.request
t0 = time.monotonic()
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
tools = [{"type": "function", "function": {
    "name": "bash", "description": "run a command with bash -c",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]
messages = [{"role": "user", "content": os.environ["CORRAL_TASK_PROMPT"]}]
model_s = 0.0


def ask():
    global model_s
    body = json.dumps({"model": os.environ["CORRAL_MODEL"], "messages": messages,
                       "tools": tools}).encode()
    request = urllib.request.Request(base + "/chat/completions", data=body, headers={
        "Authorization": "Bearer " + key, "Content-Type": "application/json"})
    t = time.monotonic()
    with urllib.request.urlopen(request, timeout=60) as answer:
        message = json.load(answer)["choices"][0]["message"]
    model_s += time.monotonic() - t
    messages.append({k: v for k, v in message.items() if v is not None})
    return message


for call in ask().get("tool_calls") or []:
    command = json.loads(call["function"]["arguments"])["command"]
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": done.stdout})
print(ask().get("content"))
print(f"AGENT_S {time.monotonic() - t0:.6f} MODEL_S {model_s:.6f}", flush=True)
"""


def p50(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ms(x: float) -> str:
    return "-" if x != x else f"{1e3 * x:.0f} ms"  # NaN: not measured


class EpisodeScript:
    """What the scripted engine answers (its ``default`` script): a ``bash`` ``ls`` call while
    the prompt offers ``bash`` and holds no tool result; then ``submit`` where the prompt
    offers it (the player: shellcraft's episode ends on it, as the env server ends an agent's
    episode with it) and plain text otherwise (the tiny agent's second turn; the agent CLIs,
    whose tools have other names, at once)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
        self.call = self.ids(call)
        self.submit = self.ids('<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>')
        self.text = self.ids("done")

    def ids(self, text: str) -> list[int]:
        return [*self.tokenizer(text, add_special_tokens=False).input_ids, self.eos]

    def __call__(self, input_ids: list[int]) -> list[int]:
        prompt = self.tokenizer.decode(input_ids)
        if "<tool_response>" not in prompt and '"name": "bash"' in prompt:
            return self.call
        if "<tool_response>" in prompt and '"name": "submit"' in prompt:
            return self.submit
        return self.text


@contextmanager
def gateway_stack() -> Iterator[str]:
    """The scripted engine and a gateway (admin token :data:`ADMIN`) on 127.0.0.1: its URL."""
    from transformers import AutoTokenizer

    from corral.engines.sglang import SGLangClient
    from corral.engines.tiny_model import cached_tiny_model
    from corral.gateway.app import build_gateway_app
    from corral.gateway.pipeline import TurnPipeline
    from corral.gateway.settings import GatewaySettings
    from corral.serving import serve_in_thread
    from tests.scripted_engine import ScriptedEngine

    tokenizer: Any = AutoTokenizer.from_pretrained(str(cached_tiny_model("qwen25")))
    script = EpisodeScript(tokenizer)
    engine = ScriptedEngine(
        eos_token_ids=[script.eos],
        decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False)),
        default=script,
    )
    settings = GatewaySettings(
        model_name=MODEL, max_context_tokens=262_144, admin_token=ADMIN, engine_timeout_s=60
    )
    with serve_in_thread(engine.app) as engine_url:
        client = SGLangClient(engine_url, timeout=60, retries=0)
        pipeline = TurnPipeline(settings, client, tokenizer)
        with serve_in_thread(build_gateway_app(settings, client, pipeline)) as url:
            yield url


def provider(name: str, state: Path) -> Any:
    """The sandbox provider ``name`` (docker: the sandbox image, which must be built)."""
    owner = f"bench-{uuid.uuid4().hex[:8]}"
    if name == "bwrap":
        from corral.sandboxes.bwrap import BwrapProvider

        return BwrapProvider(owner, state_dir=state / "bwrap")
    if name == "docker":
        from corral.sandboxes.docker import DockerProvider

        return DockerProvider(owner, image="corral-sandbox:py3")
    from corral.sandboxes.local import LocalProvider

    return LocalProvider(owner, state_dir=state / "local")


def available(name: str) -> str | None:
    """Why backend ``name`` cannot run here (None: it can)."""
    if name == "bwrap" and shutil.which("bwrap") is None:
        return "bwrap is not installed"
    if name == "docker":
        if not os.environ.get("DOCKER_HOST"):
            return "no DOCKER_HOST (start the daemon: scripts/dockerd.sh)"
        try:
            import docker

            docker.from_env().images.get("corral-sandbox:py3")
        except Exception as exc:  # no SDK, no daemon, no image: all say "not here"
            return f"docker unusable: {type(exc).__name__}: {str(exc)[:80]}"
    return None


@dataclass
class Measured:
    """One backend's numbers (seconds, per rollout)."""

    backend: str
    player_total: list[float]
    to_launch: list[float]
    agent_start: list[float]
    to_first: list[float]
    agent: list[float]
    agent_model: list[float]
    exit_to_reward: list[float]
    harness_total: list[float]
    failures: list[str]
    theirs: dict[str, list[float]]


def agent_times(transcript: str) -> tuple[float, float] | None:
    """The agent's own (run time, model calls' time) from its last line."""
    for line in reversed(transcript.splitlines()):
        parts = line.split()
        if len(parts) == 4 and parts[0] == "AGENT_S" and parts[2] == "MODEL_S":
            return float(parts[1]), float(parts[3])
    return None


async def measure(
    backend: str,
    gateway: str,
    count: int,
    agent_dir: Path,
    clis: Path | None,
    state: Path,
    progress: Progress,
) -> Measured:
    from corral.envs.server import build_app
    from corral.gateway.client import GatewayAdmin
    from corral.harnesses import harness
    from corral.rollouts.harness_play import HarnessPlayer
    from corral.rollouts.player import Player
    from corral.serving import serve_in_thread

    out = Measured(backend, [], [], [], [], [], [], [], [], [], {})
    app = build_app(
        SHELLCRAFT,
        sandbox=provider(backend, state),
        agent_gateways=[gateway],
        agent_clis=clis,
    )
    command = harness("command", command="python3 $CORRAL_AGENT_DIR/agent.py", agent_dir=agent_dir)
    clis_to_time = ["claude-code", "codex"] if clis is not None else []
    task = progress.add_task(backend, total=2 * count + len(clis_to_time))
    with serve_in_thread(app) as env_url:
        rows = await asyncio.to_thread(read_rows, env_url, count, state / f"rows-{backend}")
        async with GatewayAdmin(gateway, ADMIN) as admin:
            async with Player(admin, model=MODEL) as player:
                for row in rows:
                    rollout = await player.play(row)
                    if rollout.failed:
                        out.failures.append(f"player: {rollout.reason}")
                    else:
                        out.player_total.append(rollout.timing.total_s)
                    progress.advance(task)
            agents = HarnessPlayer(admin, command, timeout_s=AGENT_TIMEOUT_S, model=MODEL)
            for row in rows:
                done = await agents.play(row)
                progress.advance(task)
                own = agent_times(done.transcript)
                marks = done.marks
                if done.failed or own is None or marks.launched_s is None:
                    out.failures.append(f"harness: {done.reason}")
                    continue
                assert marks.first_request_s is not None and marks.agent_s is not None
                assert marks.reward_set_s is not None and done.run is not None
                out.to_launch.append(marks.launched_s)
                out.agent_start.append(done.run.started_s or float("nan"))
                out.to_first.append(marks.launched_s + marks.first_request_s)
                out.agent.append(own[0])
                out.agent_model.append(own[1])
                out.exit_to_reward.append(marks.reward_set_s - marks.launched_s - marks.agent_s)
                out.harness_total.append(done.timing.total_s)
            for name in clis_to_time:
                cli = HarnessPlayer(admin, harness(name), timeout_s=CLI_TIMEOUT_S, model=MODEL)
                times = []
                for row in rows[:2]:
                    run = (await cli.play(row)).run
                    if run is not None and run.first_request_s is not None and run.started_s:
                        times.append(run.first_request_s - run.started_s)
                    elif run is not None:
                        out.failures.append(f"{name}: no request ({run.stderr_tail[-200:]!r})")
                out.theirs[name] = times
                progress.advance(task)
    return out


def read_rows(url: str, count: int, folder: Path) -> list[Any]:
    """The first ``count`` eval rows of the shellcraft env server at ``url``: the same rows on
    every backend (one task list)."""
    from corral.rollouts.rows import Row, RowSettings, write_rows

    write_rows(url, folder, RowSettings(max_turns=2))
    lines = (folder / "eval.jsonl").read_text().splitlines()[:count]
    return [Row.model_validate_json(line) for line in lines]


def report(console: Console, results: list[Measured], skipped: dict[str, str]) -> None:
    table = Table(title="a harness rollout against the built-in player (p50 per rollout)")
    for col in (
        "backend",
        "player total",
        "to launch",
        "agent start",
        "start -> 1st request",
        "agent",
        "its model calls",
        "exit -> reward",
        "harness total",
        "corral overhead",
        "overhead / player",
        "harness / player",
    ):
        table.add_column(col, justify="right")
    for m in results:
        player, total = p50(m.player_total), p50(m.harness_total)
        overhead = p50([t - a for t, a in zip(m.harness_total, m.agent, strict=True)])
        table.add_row(
            m.backend,
            ms(player),
            ms(p50(m.to_launch)),
            ms(p50(m.agent_start)),
            ms(p50(m.to_first)),
            ms(p50(m.agent)),
            ms(p50(m.agent_model)),
            ms(p50(m.exit_to_reward)),
            ms(total),
            ms(overhead),
            "-" if overhead != overhead else f"{overhead / player:.2f}x",
            "-" if total != total else f"{total / player:.2f}x",
        )
    console.print(table)
    theirs = [(m.backend, name, t) for m in results for name, t in m.theirs.items()]
    if theirs:
        cli_table = Table(title="theirs: a real CLI's start-up (its process start -> 1st request)")
        for col in ("backend", "cli", "p50", "runs"):
            cli_table.add_column(col, justify="right")
        for backend, name, times in theirs:
            cli_table.add_row(backend, name, ms(p50(times)), str(len(times)))
        console.print(cli_table)
    for m in results:
        for failure in sorted(set(m.failures)):
            console.print(f"[yellow]{m.backend}: {m.failures.count(failure)} x {failure}")
    for backend, why in skipped.items():
        console.print(f"[yellow]{backend}: skipped: {why}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="eval rows per backend and mode")
    parser.add_argument(
        "--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS,
    )  # fmt: skip
    parser.add_argument("--no-clis", action="store_true", help="skip the real CLIs' start-up")
    args = parser.parse_args(argv)
    console = Console(width=180)
    clis = CLIS_DIR if (CLIS_DIR / "node_modules").is_dir() and not args.no_clis else None
    results: list[Measured] = []
    skipped: dict[str, str] = {}
    with ExitStack() as stack:
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="corral-bench-")))
        agent_dir = state / "agent"
        agent_dir.mkdir()
        (agent_dir / "agent.py").write_text(AGENT)
        gateway = stack.enter_context(gateway_stack())
        with Progress(console=console, transient=True) as progress:
            for backend in args.backends:
                why = available(backend)
                if why is not None:
                    skipped[backend] = why
                    continue
                measured = measure(backend, gateway, args.rows, agent_dir, clis, state, progress)
                results.append(asyncio.run(measured))
    report(console, results, skipped)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
