"""Forks: a black-box CLI's sub-agents, compaction and retries, as the gateway records them.

The real pinned CLIs (``scripts/agent_clis.sh``) play a shellcraft row through
:class:`~corral.rollouts.harness_play.HarnessPlayer`, each in the episode's own bwrap sandbox,
on a gateway in front of the scripted test engine (``tests/scripted_engine.py``), which
answers with token ids chosen here, or fails a request with an HTTP error. Real servers on
127.0.0.1 throughout (the fixtures and helpers of ``tests/test_harness_rollouts.py``).

- A Claude Code sub-agent (its ``Agent`` tool in 2.1.328) is a new conversation: its first
  request does not extend the main one, so the gateway forks (reason ``diverged``, inside the
  system message). Each branch is its own exact sample.
- Compaction (Claude Code's, made to come early with a tiny auto-compact window) rewrites the
  history twice: the summary request (the history cut short, then a request for a summary)
  and the compacted conversation (a new system prompt, the summary, the latest messages):
  two forks, both ``diverged``, three samples.
- A retried request (the engine fails it; the CLI resends it) leaves nothing of the failed
  attempt: the gateway records only served turns, and the retry is the same request, token
  for token, so it continues the trajectory. No fork.

Tests that need a CLI or bubblewrap skip when they are missing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from corral.envs.server import build_app
from corral.gateway.client import GatewayAdmin
from corral.harnesses.base import Harness
from corral.harnesses.claude_code import MODEL_VARS, QUIET_ENV
from corral.rollouts.harness_play import HarnessPlayer, HarnessRollout, make_harness
from corral.samples import Sample
from tests.gateway_stack import ADMIN, ScriptedStack, scripted_gateway
from tests.scripted_engine import Failure, Received
from tests.servers import serve
from tests.test_harness_rollouts import (
    AGENT_TIMEOUT_S,
    CLIS_DIR,
    CONTEXT,
    FINAL_TEXT,
    MODEL,
    SHELL_TOOL,
    SHELLCRAFT,
    _need_cli,
    _provider,
    shellcraft_row,
    solution,
)

SUB_FINAL_TEXT = "Sub-agent done."
# What the command prints only when a shell really ran it (the call's text has no "42").
RAN = " && echo ran-$((6*7))"


@pytest.fixture
def gateway(tiny_model_dir: Path) -> Iterator[ScriptedStack]:
    with scripted_gateway(tiny_model_dir, model_name=MODEL, context=CONTEXT) as stack:
        yield stack


class ViewingAdmin(GatewayAdmin):
    """The gateway's admin client, keeping each session's view (``GET /sessions/<id>``: its
    trajectories, turns and drift report) as it was just before the player closes it: the
    player deletes its session when the rollout ends, and with it the drift report."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(url, token)
        self.views: dict[str, dict[str, Any]] = {}

    async def close_session(self, session_id: str) -> None:
        self.views[session_id] = await self.view(session_id)
        await super().close_session(session_id)


@asynccontextmanager
async def player(
    stack: ScriptedStack, harness: Harness
) -> AsyncIterator[tuple[ViewingAdmin, HarnessPlayer]]:
    admin = ViewingAdmin(stack.url, ADMIN)
    async with (
        admin,
        HarnessPlayer(admin, harness, timeout_s=AGENT_TIMEOUT_S, model=MODEL) as played,
    ):
        yield admin, played


def described(rollout: HarnessRollout, view: dict[str, Any] | None = None) -> str:
    """What to print when an assertion fails: the reason, the transcript, the drift report."""
    run = rollout.run
    text = f"{rollout.reason}\n"
    if run is not None:
        text += f"--- transcript ---\n{run.transcript[-6000:]}\n--- stderr ---\n{run.stderr_tail}"
    if view is not None:
        text += f"\n--- drift ---\n{json.dumps(view['drift'], indent=1)}"
    return text


def check_branch(sample: Sample, calls: list[Received]) -> None:
    """``sample`` is exactly the branch the engine played in ``calls`` (in order): its tokens
    are the last call's input + output, each call's input + output is a prefix of them, mask 1
    exactly on the engine's output tokens with the engine's logprobs, 0 elsewhere."""
    tokens, prompt_len = sample.tokens, len(calls[0].input_ids)
    last = calls[-1]
    assert tokens == last.input_ids + last.output_ids
    assert sample.response_length == len(tokens) - prompt_len
    mask, logprobs = [0] * len(tokens), [0.0] * len(tokens)
    for call in calls:
        start = len(call.input_ids)
        assert tokens[: start + len(call.output_ids)] == call.input_ids + call.output_ids
        mask[start : start + len(call.output_ids)] = [1] * len(call.output_ids)
        logprobs[start : start + len(call.logprobs)] = call.logprobs
    assert sample.loss_mask == mask[prompt_len:]
    assert sample.rollout_log_probs == pytest.approx(logprobs[prompt_len:], abs=1e-6)
    assert sample.metadata["num_turns"] == len(calls)
    assert sample.status == "completed"


def system_message(stack: ScriptedStack, call: Received) -> str:
    """The system message the gateway rendered for ``call`` (Qwen 2.5's template)."""
    text = str(stack.tokenizer.decode(call.input_ids))
    assert text.startswith("<|im_start|>system\n")
    return text.split("<|im_end|>", 1)[0]


# -- Claude Code: a sub-agent ----------------------------------------------------------------


async def test_a_claude_code_sub_agent_is_its_own_sample(
    gateway: ScriptedStack, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Claude Code's ``Agent`` tool (2.1.328; ``description``, ``prompt``, ``subagent_type``,
    ``run_in_background``) starts a sub-agent: a new conversation with its own system prompt
    (marked ``cc_is_subagent=true`` in its first line) and the given prompt as its task. The
    engine plays, in order: the main agent's ``Agent`` call, the sub-agent's shell call (the
    task's solution), the sub-agent's final text, and, once the main agent holds the
    sub-agent's report as the tool's result, its own final text.

    The sub-agent's first request extends nothing held, so the gateway starts a trajectory:
    the drift report counts one fork, ``diverged`` inside message 0 (the system message; not in
    model output), against the main trajectory. Its second request extends its own trajectory
    and the main agent's last request extends the main one: two samples, each exact. The
    sub-agent offers tools, so neither is a ``side`` request; the workspace it left is
    graded."""
    _need_cli("claude-code")
    provider = _provider("bwrap", request, tmp_path)
    app = build_app(SHELLCRAFT, sandbox=provider, agent_clis=CLIS_DIR, tool_timeout=30.0)
    with serve(app) as url:
        row, task = shellcraft_row(url)
        spawn = {
            "description": "Write the answer",
            "prompt": "Run the command that writes the answer file.",
            "subagent_type": "general-purpose",
            # In the foreground: its report is the tool's result (in the background it
            # would come later, as a notification).
            "run_in_background": False,
        }
        tool, argument = SHELL_TOOL["claude-code"]
        gateway.engine.push(
            gateway.tool_call("Agent", spawn),
            gateway.tool_call(tool, {argument: solution(task) + RAN}),
            gateway.ids(SUB_FINAL_TEXT),
            gateway.ids(FINAL_TEXT),
        )
        claude_code = make_harness("claude-code", settings={"max_retries": 0})
        async with player(gateway, claude_code) as (admin, played):
            rollout = await played.play(row, group_index=0, index=0)
    view = admin.views[rollout.session_id]
    why = described(rollout, view)
    assert not rollout.failed and rollout.reward == pytest.approx(1.0), why
    calls = gateway.engine.requests
    assert len(calls) == 4 and all(c.status == 200 for c in calls), why
    assert gateway.engine.pending == 0 and rollout.turns == 4
    main, sub = [calls[0], calls[3]], [calls[1], calls[2]]
    assert "cc_is_subagent=true" in system_message(gateway, sub[0])
    assert "cc_is_subagent" not in system_message(gateway, main[0])

    # Two samples, in the order their trajectories started: the main agent's, the sub-agent's.
    assert len(rollout.samples) == 2, why
    main_sample, sub_sample = rollout.samples
    check_branch(main_sample, main)
    check_branch(sub_sample, sub)
    assert [s.metadata["origin"] for s in rollout.samples] == ["first_turn", "diverged"]
    assert [s.metadata["label"] for s in rollout.samples] == [None, None]
    assert all(s.reward == rollout.reward for s in rollout.samples)
    # The sub-agent's report reached the main agent as its tool's result (mask 0 there).
    between = main_sample.tokens[len(main[0].input_ids) + len(main[0].output_ids) :]
    assert SUB_FINAL_TEXT in gateway.tokenizer.decode(between)
    # And the shell's output is in the sub-agent's branch, not the main one.
    assert "ran-42" in gateway.tokenizer.decode(sub_sample.tokens[len(sub[0].input_ids) :])
    assert "ran-42" not in gateway.tokenizer.decode(main_sample.tokens)

    drift = view["drift"]
    assert drift["turns"] == 4 and drift["merges"] == 2 and drift["forks"] == 1, why
    assert drift["by_reason"] == {"first_turn": 1, "diverged": 1, "extends": 2}
    (event,) = drift["events"]
    assert event["turn"] == 1 and event["reason"] == "diverged"
    assert event["compared_trajectory"] == 0
    assert (event["message_index"], event["message_role"]) == (0, "system")
    assert not event["in_model_output"]
    assert event["explanation"].startswith("a new conversation: its system message differs")
    # The sample carries the same explanation as the drift report.
    assert sub_sample.metadata["drift"] == event
    assert [t["turns"] for t in view["trajectories"]] == [[0, 3], [1, 2]]


# -- Claude Code: context compaction --------------------------------------------------------

# Claude Code compacts its context once it nears its auto-compact window; these make that
# window tiny, so that compaction comes after two tool calls (measured with 2.1.328: at 1% or
# 5% of a 40k window alike, it came before a run's third request, never before its second).
COMPACT_ENV = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "40000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "1"}
SUMMARY_TEXT = "<summary>The answer file is written.</summary>"


def compacting_claude() -> Harness:
    """Claude Code as the ``claude-code`` harness runs it (its argv, its model and quiet
    variables, no retries), with :data:`COMPACT_ENV` added: a ``command`` harness, since the
    ``claude-code`` harness sets no other variable. ``claude`` is on the agent's PATH."""
    env = {var: "$CORRAL_MODEL" for var in MODEL_VARS}
    env |= {**QUIET_ENV, **COMPACT_ENV, "CLAUDE_CODE_MAX_RETRIES": "0"}
    env["CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK"] = "1"
    exports = " ".join(f'{k}="{v}"' for k, v in env.items())
    argv = 'claude -p "$CORRAL_TASK_PROMPT" --output-format stream-json --verbose'
    argv += " --permission-mode bypassPermissions"
    return make_harness("command", agent_cmd=f"export {exports}; exec {argv}")


async def test_claude_code_compaction_forks_twice(
    gateway: ScriptedStack, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Compaction rewrites the history, so the gateway forks at each rewrite.

    The engine plays two shell calls (the solution, then ``ls``); Claude Code, past its
    (tiny) window, then sends the *summary request*: the history up to the first tool's
    result, then a user message asking for an ``<analysis>`` and a ``<summary>`` (and offering
    its tools all the same, so it is not a ``side`` request). That is not a prefix of what is
    held: fork 1, ``diverged`` inside that user message, in rendered tokens (not model
    output). The engine answers with a summary; Claude Code then restarts the conversation
    from it: a new system prompt, the summary as a user message, the most recent messages kept
    verbatim after it: fork 2, ``diverged`` inside the system message. The engine answers.

    Three samples, each exact: the pre-compaction conversation (two turns), the summary
    request (its whole prompt mask 0, the summary mask 1), and the compacted conversation
    (the summary and the kept calls in its prompt, mask 0). Graded."""
    _need_cli("claude-code")
    provider = _provider("bwrap", request, tmp_path)
    app = build_app(SHELLCRAFT, sandbox=provider, agent_clis=CLIS_DIR, tool_timeout=30.0)
    with serve(app) as url:
        row, task = shellcraft_row(url)
        tool, argument = SHELL_TOOL["claude-code"]
        gateway.engine.push(
            gateway.tool_call(tool, {argument: solution(task) + RAN}),
            gateway.tool_call(tool, {argument: "ls"}),
            gateway.ids(SUMMARY_TEXT),
            gateway.ids(FINAL_TEXT),
        )
        async with player(gateway, compacting_claude()) as (admin, played):
            rollout = await played.play(row, group_index=0, index=0)
    view = admin.views[rollout.session_id]
    why = described(rollout, view)
    assert not rollout.failed and rollout.reward == pytest.approx(1.0), why
    calls = gateway.engine.requests
    assert len(calls) == 4 and all(c.status == 200 for c in calls), why
    assert gateway.engine.pending == 0 and rollout.turns == 4

    assert len(rollout.samples) == 3, why
    before, summary, after = rollout.samples
    check_branch(before, calls[:2])
    check_branch(summary, [calls[2]])
    check_branch(after, [calls[3]])
    assert [s.metadata["origin"] for s in rollout.samples] == ["first_turn", "diverged", "diverged"]
    assert [s.metadata["label"] for s in rollout.samples] == [None, None, None]
    decode = gateway.tokenizer.decode
    # The compacted conversation's prompt holds the summary the engine wrote, and the most
    # recent call (``ls``) kept verbatim; never trained on there.
    compacted = decode(calls[3].input_ids)
    assert "The answer file is written." in compacted and '"command": "ls"' in compacted
    assert after.loss_mask == [1] * len(calls[3].output_ids)

    drift = view["drift"]
    assert drift["turns"] == 4 and drift["merges"] == 1 and drift["forks"] == 2, why
    assert drift["by_reason"] == {"first_turn": 1, "extends": 1, "diverged": 2}
    asked, restarted = drift["events"]
    # Fork 1: the summary request shares the history up to the first tool's result, then
    # asks for the summary where the held trajectory has the model's second call.
    assert asked["turn"] == 2 and asked["reason"] == "diverged"
    assert asked["compared_trajectory"] == 0 and asked["message_role"] == "user"
    assert not asked["in_model_output"]
    first_answer_end = len(calls[0].input_ids) + len(calls[0].output_ids)
    assert first_answer_end < asked["position"] < len(calls[1].input_ids)
    assert "<summary>" in decode(calls[2].input_ids[asked["position"] :])
    # Fork 2: the compacted conversation starts over, inside the system message.
    assert restarted["turn"] == 3 and restarted["reason"] == "diverged"
    assert (restarted["message_index"], restarted["message_role"]) == (0, "system")
    assert not restarted["in_model_output"]
    assert [t["turns"] for t in view["trajectories"]] == [[0, 1], [2], [3]]


# -- retries ---------------------------------------------------------------------------------


async def retried_rollout(
    stack: ScriptedStack, harness: str, request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[HarnessRollout, dict[str, Any]]:
    """``harness`` (with one retry) plays a row while the engine fails the first attempt at
    each of its two requests (HTTP 500; the gateway answers 502 ``engine_error``): the CLI
    must resend each. Returns the rollout and its session's last view."""
    _need_cli(harness)
    provider = _provider("bwrap", request, tmp_path)
    app = build_app(SHELLCRAFT, sandbox=provider, agent_clis=CLIS_DIR, tool_timeout=30.0)
    with serve(app) as url:
        row, task = shellcraft_row(url)
        tool, argument = SHELL_TOOL[harness]
        stack.engine.push(
            Failure(500, "scripted failure: the first attempt"),
            stack.tool_call(tool, {argument: solution(task) + RAN}),
            Failure(500, "scripted failure: the first attempt after the tool"),
            stack.ids(FINAL_TEXT),
        )
        retrying = make_harness(harness, settings={"max_retries": 1})
        async with player(stack, retrying) as (admin, played):
            rollout = await played.play(row, group_index=0, index=0)
    return rollout, admin.views[rollout.session_id]


@pytest.mark.parametrize("harness", ["claude-code", "codex"])
async def test_a_retried_request_continues_its_trajectory(
    harness: str, gateway: ScriptedStack, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A request the engine failed and the CLI retried (Claude Code's
    ``CLAUDE_CODE_MAX_RETRIES=1``; Codex's ``request_max_retries = 1``) is recorded once.

    The gateway records a turn only when the engine served it: the failed attempt (a 502 to
    the client) leaves no turn, no tokens and no drift event. The retry is the same request,
    rendered to the same token ids (checked against what the engine received both times), so
    it is recorded as if the failure never happened: the first retry is the session's first
    turn, the second extends it. One exact sample, no fork, graded."""
    rollout, view = await retried_rollout(gateway, harness, request, tmp_path)
    why = described(rollout, view)
    assert not rollout.failed and rollout.reward == pytest.approx(1.0), why
    calls = gateway.engine.requests
    assert [c.status for c in calls] == [500, 200, 500, 200], why
    assert gateway.engine.pending == 0
    # Each retry resent exactly the failed attempt's tokens.
    assert calls[1].input_ids == calls[0].input_ids
    assert calls[3].input_ids == calls[2].input_ids
    assert calls[0].output_ids == [] and calls[2].output_ids == []
    # Only the served attempts are turns; they make one trajectory.
    assert rollout.turns == 2
    (sample,) = rollout.samples
    check_branch(sample, [calls[1], calls[3]])
    assert "ran-42" in gateway.tokenizer.decode(sample.tokens[len(calls[1].input_ids) :])
    assert view["drift"] == {
        "turns": 2,
        "merges": 1,
        "forks": 0,
        "by_reason": {"first_turn": 1, "extends": 1},
        "events": [],
        "history_fallbacks": [],
    }
    assert sample.metadata["origin"] == "first_turn" and sample.metadata["drift"] is None
    if harness == "claude-code":
        # Claude Code says so in its transcript: one api_retry event per failed attempt.
        assert rollout.run is not None
        assert rollout.run.transcript.count('"subtype":"api_retry"') == 2, why
