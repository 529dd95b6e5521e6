"""Rollouts through harnesses: a black-box agent plays a row inside the episode's own sandbox
(:class:`~corral.rollouts.harness_play.HarnessPlayer`), graded on the workspace it leaves.

Real servers on 127.0.0.1 throughout: the env server (``build_app`` with the agent CLIs, what
``corral serve --agent-clis`` runs) serving shellcraft in bwrap or docker sandboxes, and the
gateway in front of the scripted test engine (``tests/scripted_engine.py``), which answers with
token ids chosen here: one shell tool call, then a short final text. So Claude Code and Codex
really run the command in the sandbox (one computed here from the task's parameters, with
shellcraft's reference solver, or one that writes a wrong file), the workspace changes, the
verifier grades it, and the session's one sample holds the tool's result with loss mask 0.
Also: the failure rules, ``corral play --harness`` and ``corral eval``'s harness path (a
``command`` agent in python3's standard library), the host mode's non-dumpable process, and a
run against the tiny model on the local engine that must end (flagged or graded) within its
budget. The real CLIs are the pinned ones (``scripts/agent_clis.sh``); tests that need them
skip when they are not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral.cli.harness import harness_options
from corral.envs.agent_clis import find_agent_clis
from corral.envs.bundle import load_bundle
from corral.envs.protocol import AgentResult, AgentRun
from corral.envs.server import build_app
from corral.gateway.client import GatewayAdmin
from corral.rollouts.harness_play import (
    HarnessOptions,
    HarnessPlayer,
    HarnessRollout,
    _Outcome,
    add_harness_arguments,
    make_harness,
)
from corral.rollouts.rows import EnvRef, Row, RowMetadata
from corral.sandboxes.bwrap import BwrapProvider
from corral.sandboxes.local import LocalProvider
from tests.conftest import ROOT, SANDBOX_IMAGE
from tests.gateway_stack import ADMIN, ScriptedStack, scripted_gateway
from tests.servers import serve

SHELLCRAFT = ROOT / "bundles" / "shellcraft"
GRIDSIM = ROOT / "bundles" / "gridsim"
CLIS_DIR = Path(os.environ.get("CORRAL_AGENT_CLIS", "/var/cache/corral-agent-clis"))
MODEL = "corral-test-model"
CONTEXT = 262_144  # Claude Code's first request is ~30k tokens with the tiny tokenizer
FINAL_TEXT = "Done."
AGENT_TIMEOUT_S = 180.0
# The tool each CLI runs shell commands with, and the name of its command argument.
SHELL_TOOL = {"claude-code": ("Bash", "command"), "codex": ("exec_command", "cmd")}


# -- fixtures --------------------------------------------------------------------------------


def _need_cli(harness: str) -> None:
    if not CLIS_DIR.is_dir():
        pytest.skip(f"the agent CLIs are not installed (bash scripts/agent_clis.sh {CLIS_DIR})")
    clis = find_agent_clis(CLIS_DIR)
    if (clis.claude if harness == "claude-code" else clis.codex) is None:
        pytest.skip(f"{harness}'s CLI is not in {CLIS_DIR} (bash scripts/agent_clis.sh DIR)")


def _provider(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    owner = f"test-{uuid.uuid4().hex[:8]}"
    if backend == "docker":
        request.getfixturevalue("docker_daemon")
        from corral.sandboxes.docker import DockerProvider

        return DockerProvider(owner, image=SANDBOX_IMAGE)
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    return BwrapProvider(owner, state_dir=tmp_path / "state")


@pytest.fixture
def gateway(tiny_model_dir: Path) -> Iterator[ScriptedStack]:
    with scripted_gateway(tiny_model_dir, model_name=MODEL, context=CONTEXT) as stack:
        yield stack


def shellcraft_row(url: str, split: str = "eval", index: int = 0) -> tuple[Row, Any]:
    """The row of shellcraft task ``split``/``index`` on the server at ``url``, and the task."""
    bundle = load_bundle(SHELLCRAFT)
    task = bundle.task(split, index)
    ref = EnvRef(
        url=url,
        token_var=None,
        max_turns=8,
        tool_timeout=30.0,
        reset_timeout=120.0,
        model_timeout=120.0,
    )
    row = Row(
        messages=[{"role": "user", "content": task.prompt}],
        metadata=RowMetadata(split=split, index=index, task_id=task.id, tools=[], env=ref),
    )
    return row, task


def answer_files(task: Any) -> list[str]:
    bundle = load_bundle(SHELLCRAFT)
    return sorted(bundle.env_task(task).data["output_files"])


def solution(task: Any) -> str:
    """One shell command line that writes the task's answer files (shellcraft's reference
    solver, from the task's parameters)."""
    from bundles.shellcraft.solver import solve

    return " && ".join(f"{{ {command}; }}" for command in solve(task.data))


def check_sample(stack: ScriptedStack, rollout: HarnessRollout, tool_output: str) -> None:
    """One sample: mask 1 exactly on the engine's tokens; ``tool_output`` (what the command
    the agent ran printed, as its CLI sent it back) lies between the two answers, mask 0."""
    calls = stack.engine.requests
    assert len(rollout.samples) == 1, [s.status for s in rollout.samples]
    (sample,) = rollout.samples
    assert sample.status == "completed" and sample.reward == rollout.reward
    tokens, prompt_len = sample.tokens, len(calls[0].input_ids)
    first, last = calls[0], calls[-1]
    assert tokens == last.input_ids + last.output_ids
    mask = [0] * len(tokens)
    for call in calls:
        start = len(call.input_ids)
        mask[start : start + len(call.output_ids)] = [1] * len(call.output_ids)
    assert sample.loss_mask == mask[prompt_len:]
    between = slice(len(first.input_ids) + len(first.output_ids), len(last.input_ids))
    assert tool_output in stack.tokenizer.decode(tokens[between])
    assert set(mask[between]) == {0}


# -- the rules -------------------------------------------------------------------------------


def _result(**run: Any) -> AgentResult:
    status = run.pop("status", "graded")
    reward = run.pop("reward", 1.0 if status == "graded" else None)
    fields = {"exit_code": 0, **run}
    return AgentResult(
        run=AgentRun(**fields), status=status, reward=reward, grade_error=run.get("why")
    )


@pytest.mark.parametrize(
    ("result", "turns", "reason"),
    [
        (_result(exit_code=None, timed_out=True), 3, "agent: did not exit within 9 s"),
        (_result(exit_code=None, killed_reason="oom"), 3, "agent: killed: oom"),
        (_result(exit_code=2, stderr_tail="boom"), 3, "agent: exited with code 2"),
        (_result(), 0, "no model turn"),
        (_result(status="error"), 3, "no reward: the episode was not graded"),
        (_result(), 2, None),
    ],
)
def test_the_rules_of_a_finished_agent_run(
    result: AgentResult, turns: int, reason: str | None
) -> None:
    """An agent that overran, was killed, failed or never used its model fails the rollout
    even when the episode was graded (never a 0); only a clean, graded run is rewarded."""
    outcome = _Outcome(result=result)
    outcome.judge(9.0, turns)
    if reason is None:
        assert outcome.reason is None and outcome.reward == 1.0
    else:
        assert outcome.reason is not None and reason in outcome.reason, outcome.reason
    if result.run.stderr_tail:
        assert outcome.reason is not None and outcome.reason.endswith("boom")


async def test_a_server_that_runs_no_agent_fails_the_rollout(gateway: ScriptedStack) -> None:
    """gridsim has no ``[agent]`` section and runs in the server's process: the server
    refuses the agent frame, the rollout is failed with the env's reason (never scored), and
    its session is flagged failed and closed."""
    with serve(build_app(GRIDSIM)) as url:
        row, _ = shellcraft_row(url)
        gridsim_row = Row(
            messages=row.messages,
            metadata=row.metadata.model_copy(update={"split": "train", "index": 0}),
        )
        async with (
            GatewayAdmin(gateway.url, ADMIN) as admin,
            HarnessPlayer(admin, make_harness("command", agent_cmd="true"), timeout_s=5) as player,
        ):
            rollout = await player.play(gridsim_row, group_index=4, index=1)
    assert rollout.failed and rollout.reward is None
    assert rollout.reason is not None and rollout.reason.startswith("env: the agent was not run")
    assert rollout.run is None and rollout.harness == "command"
    # The session recorded nothing: one aborted sample with the group's numbering.
    (sample,) = rollout.samples
    assert sample.status == "aborted" and sample.remove_sample
    assert (sample.group_index, sample.index) == (4, 1)
    assert gateway.engine.requests == []


async def test_a_gateway_without_an_admin_token_is_refused(tiny_model_dir: Path) -> None:
    """A gateway whose admin routes are open would let the agent set its own reward through
    its session's URL: the player refuses it before any session or episode is opened (the
    gateway's engine is never reached: it need not exist; nor the row's env server).
    Control: the scripted gateways of the other tests have a token and pass the same check."""
    from corral.gateway.server import create_gateway
    from corral.rollouts.player import PlayerError
    from corral.serving import free_port, serve_in_thread

    dead_engine = f"http://127.0.0.1:{free_port()}"
    with serve_in_thread(create_gateway(dead_engine, tiny_model_dir)) as open_url:
        async with (
            GatewayAdmin(open_url) as admin,
            HarnessPlayer(admin, make_harness("command", agent_cmd="true"), timeout_s=5) as player,
        ):
            assert not await admin.admin_needs_token()
            row, _ = shellcraft_row("http://127.0.0.1:9")  # never reached
            with pytest.raises(PlayerError, match="without a token"):
                await player.play(row)


def test_harness_flags() -> None:
    from corral.cli.errors import UsageError

    parser = argparse.ArgumentParser()
    add_harness_arguments(parser)
    assert harness_options(parser.parse_args([])) is None
    made = harness_options(
        parser.parse_args(["--harness", "codex", "--sandbox-gateway", "http://10.0.0.2:8000/x"])
    )
    assert made is not None and made.harness.name == "codex"
    assert made.sandbox_gateway == "http://10.0.0.2:8000" and made.timeout_s == 600.0
    for bad in (
        ["--harness", "command"],  # no command
        ["--harness", "codex", "--agent-cmd", "x"],
        ["--agent-dir", "."],  # without --harness
        ["--harness", "command", "--agent-cmd", "x", "--timeout", "0"],
    ):
        with pytest.raises(UsageError):
            harness_options(parser.parse_args(bad))


def test_corral_play_needs_an_agent_command_or_a_harness(tmp_path: Path) -> None:
    from corral.cli import main

    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    assert main(["play", str(rows), "--gateway", "http://127.0.0.1:9"]) == 2
    assert main(["play", str(rows), "--gateway", "http://127.0.0.1:9", "--harness", "command"]) == 2


def test_host_mode_makes_corral_play_non_dumpable(tmp_path: Path) -> None:
    """After :func:`make_undumpable` a process of the same uid without CAP_SYS_PTRACE can no
    longer read the process's environment (where the tokens are); before, it can. (Run as
    root, both sides drop every capability: a process holding more than the reader is not
    readable in any case.)"""
    if sys.platform != "linux" or shutil.which("setpriv") is None:
        pytest.skip("needs Linux and setpriv (util-linux)")
    script = (
        "import sys\n"
        "from corral.adapters.agents import make_undumpable\n"
        "if sys.argv[1] == 'yes': assert make_undumpable()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )

    # Every capability dropped (CAP_SYS_PTRACE too), from both: a same-uid process at its
    # weakest reading one that holds no more capabilities than it does.
    capless = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]

    def readable(undumpable: bool) -> bool:
        env = {**os.environ, "CORRAL_TEST_SECRET": "s3cret"}
        proc = subprocess.Popen(
            [*capless, sys.executable, "-c", script, "yes" if undumpable else "no"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            peek = subprocess.run(
                [*capless, "cat", f"/proc/{proc.pid}/environ"], capture_output=True
            )
            return peek.returncode == 0 and b"s3cret" in peek.stdout
        finally:
            proc.communicate("", timeout=30)

    assert readable(False)
    assert not readable(True)


# -- the real CLIs in sandboxes --------------------------------------------------------------


@pytest.mark.parametrize("right", [True, False], ids=["solved", "wrong"])
@pytest.mark.parametrize("backend", ["bwrap", "docker"])
@pytest.mark.parametrize("harness", ["claude-code", "codex"])
async def test_a_cli_plays_a_shellcraft_row_in_the_episodes_sandbox(
    harness: str,
    backend: str,
    right: bool,
    gateway: ScriptedStack,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """The agent runs the scripted command in the sandbox's workspace; the verifier grades
    the folder it leaves: 1 for the reference solution, 0 for a wrong answer file."""
    _need_cli(harness)
    provider = _provider(backend, request, tmp_path)
    app = build_app(SHELLCRAFT, sandbox=provider, agent_clis=CLIS_DIR, tool_timeout=30.0)
    with serve(app) as url:
        row, task = shellcraft_row(url)
        (answer,) = answer_files(task)
        command = solution(task) if right else f"printf 'wrong\\n' > {answer} && ls"
        # Printed only when the shell really ran it (the call's text has no "42").
        command += " && echo ran-$((6*7))"
        tool, argument = SHELL_TOOL[harness]
        gateway.engine.push(gateway.tool_call(tool, {argument: command}), gateway.ids(FINAL_TEXT))
        async with (
            GatewayAdmin(gateway.url, ADMIN) as admin,
            HarnessPlayer(
                admin, make_harness(harness), timeout_s=AGENT_TIMEOUT_S, model=MODEL
            ) as player,
        ):
            began = time.monotonic()
            rollout = await player.play(row, group_index=0, index=0)
            took = time.monotonic() - began
    run = rollout.run
    assert run is not None, rollout.reason
    described = f"{rollout.reason}\n--- transcript ---\n{run.transcript[-6000:]}\n" + (
        f"--- stderr ---\n{run.stderr_tail}"
    )
    assert not rollout.failed, described
    assert run.exit_code == 0 and not run.timed_out
    assert rollout.reward == pytest.approx(1.0 if right else 0.0), (rollout.scores, described)
    assert rollout.scores["submitted"] == 1.0  # the bundle's finish tool ended the episode
    assert rollout.turns == 2 and len(gateway.engine.requests) == 2
    assert gateway.engine.pending == 0
    assert FINAL_TEXT in run.transcript  # the transcript stream holds the final answer
    # The rollout's marks: the agent reached the gateway, the reward landed after it ended.
    marks = rollout.marks
    assert run.first_request_s is not None and 0 < run.first_request_s <= run.seconds
    assert marks.launched_s is not None and marks.reward_set_s is not None
    assert marks.launched_s < marks.reward_set_s <= took
    assert rollout.samples[0].metadata["harness"] == harness
    check_sample(gateway, rollout, "ran-42")
    assert await provider.list_owned() == []


# -- corral play --harness and corral eval's harness path ------------------------------------

# A command agent: one chat-completions call through its session (python3's standard library),
# then the answer file written with the shell line in $SOLUTION.
COMMAND_AGENT = r"""
import json, os, subprocess, sys, urllib.request
body = json.dumps({"model": os.environ["CORRAL_MODEL"],
                   "messages": [{"role": "user", "content": os.environ["CORRAL_TASK_PROMPT"]}]})
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions", body.encode(),
    {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
     "Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=60))
print(json.dumps({"said": reply["choices"][0]["message"]["content"]}), flush=True)
subprocess.run(["bash", "-c", open(os.environ["CORRAL_AGENT_DIR"] + "/solution.sh").read()],
               check=True, stdout=sys.stderr)  # the transcript (stdout) stays JSON lines
print(json.dumps({"files": sorted(os.listdir("."))}), flush=True)
"""


def test_corral_play_and_eval_with_a_command_harness(
    gateway: ScriptedStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``corral play ROWS --harness command``: the agent plays in the episode's sandbox; the
    outputs hold the episode (reward 1, the agent's run), its samples, the summary and the
    transcript. Then the same row through ``eval_rows(..., harness=...)``."""
    import asyncio

    from corral.cli import main
    from corral.rollouts.evals import eval_rows, write_eval

    # The local backend (no isolation) is enough here: what is under test is the command
    # line, the outputs and eval's path, not the sandbox (the CLI tests above cover those).
    provider = LocalProvider(f"test-{uuid.uuid4().hex[:8]}", state_dir=tmp_path / "state")
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    (agent_dir / "agent.py").write_text(COMMAND_AGENT)
    with serve(build_app(SHELLCRAFT, sandbox=provider)) as url:
        row, task = shellcraft_row(url)
        (agent_dir / "solution.sh").write_text(solution(task) + "\n")
        rows = tmp_path / "rows.jsonl"
        rows.write_text(row.model_dump_json() + "\n")
        gateway.engine.push(gateway.ids(FINAL_TEXT))
        os.environ["CORRAL_TEST_ADMIN"] = ADMIN
        try:
            out = tmp_path / "play"
            rc = main([
                "play", str(rows), "--gateway", gateway.url, "--admin-token-var",
                "CORRAL_TEST_ADMIN", "--harness", "command", "--agent-cmd",
                'python3 "$CORRAL_AGENT_DIR/agent.py"', "--agent-dir", str(agent_dir),
                "--model", MODEL, "--timeout", "60", "--out", str(out),
            ])  # fmt: skip
        finally:
            del os.environ["CORRAL_TEST_ADMIN"]
        printed = capsys.readouterr()
        assert rc == 0, printed
        (episode,) = [json.loads(line) for line in (out / "episodes.jsonl").open()]
        assert episode["reward"] == 1.0 and not episode["failed"], episode
        assert episode["agent"]["exit_code"] == 0 and episode["agent"]["harness"] == "command"
        assert episode["agent"]["reward_set_s"] is not None
        assert len((out / "samples.jsonl").read_text().splitlines()) == 1
        assert json.loads((out / "summary.json").read_text())["mean"] == 1.0
        transcript = [json.loads(x) for x in (out / "transcripts" / "0.jsonl").open()]
        assert transcript[0] == {"said": FINAL_TEXT}
        assert answer_files(task)[0] in transcript[1]["files"]
        # The harness rollout's spans: the agent's run inside the episode, its first model
        # request inside the run, all under the session the episode line names.
        spans = {s["name"]: s for s in map(json.loads, (out / "traces.jsonl").open())}
        assert {"episode", "session_open", "env_reset", "agent", "grading"} <= set(spans)
        assert {s["session_id"] for s in spans.values()} == {episode["session_id"]}
        agent, whole = spans["agent"], spans["episode"]
        assert whole["start_s"] <= agent["start_s"] <= agent["end_s"] <= whole["end_s"]
        assert spans["first_model_request"]["parent"] == "agent"
        assert agent["attrs"]["exit_code"] == 0

        # corral eval's path: the same row, the harness given to eval_rows.
        gateway.engine.push(gateway.ids(FINAL_TEXT))
        options = HarnessOptions(
            make_harness(
                "command", agent_cmd='python3 "$CORRAL_AGENT_DIR/agent.py"', agent_dir=agent_dir
            ),
            timeout_s=60,
            model=MODEL,
        )
        report = asyncio.run(eval_rows([row], gateway.url, admin_token=ADMIN, harness=options))
    assert report.overall.mean == 1.0 and report.overall.failed == 0
    (record,) = report.episodes
    assert record.agent is not None and record.agent["exit_code"] == 0
    assert record.group == task.data["family"]  # the bundle's [eval] group_by
    write_eval(report, tmp_path / "eval")
    line = json.loads((tmp_path / "eval" / "episodes.jsonl").read_text())
    assert "transcript" not in line and line["agent"]["harness"] == "command"
    assert (tmp_path / "eval" / "transcripts" / "0.jsonl").read_text().startswith('{"said"')


# -- the tiny model --------------------------------------------------------------------------


@pytest.mark.parametrize("harness", ["claude-code", "codex"])
async def test_with_the_tiny_model_a_run_ends_within_its_budget(
    harness: str,
    tiny_model_dir: Path,
    engine_url: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """The tiny model on the local engine says nothing useful: the run must still end, graded
    or flagged failed with a reason, within the agent's budget (plus ending and grading)."""
    from tests.gateway_stack import gateway_stack

    _need_cli(harness)
    provider = _provider("docker", request, tmp_path)
    budget = 60.0
    app = build_app(SHELLCRAFT, sandbox=provider, agent_clis=CLIS_DIR, tool_timeout=30.0)
    with (
        gateway_stack(tiny_model_dir, engine_url, timeout=30.0) as stack,
        serve(app) as url,
    ):
        row, _ = shellcraft_row(url)
        async with (
            GatewayAdmin(stack.url, ADMIN) as admin,
            HarnessPlayer(
                admin, make_harness(harness), timeout_s=budget, model="tiny",
                sampling={"max_tokens": 32},
            ) as player,
        ):  # fmt: skip
            began = time.monotonic()
            rollout = await player.play(row, group_index=0, index=0)
            took = time.monotonic() - began
    assert took < budget + 60.0
    assert rollout.failed == (rollout.reward is None)
    if rollout.failed:
        assert rollout.reason, rollout
        assert all(s.status in ("failed", "aborted") for s in rollout.samples)
    else:
        assert rollout.reward is not None and 0.0 <= rollout.reward <= 1.0
    assert await provider.list_owned() == []
