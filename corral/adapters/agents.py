"""Black-box agents: play rows with any program that speaks the OpenAI API and MCP.

``corral play ROWS --gateway URL --agent-cmd "..."`` (:mod:`corral.cli.play`, over
:func:`play_with_agent` / :func:`play_rows_with_agent`) replaces the player's turn loop with a
process of the user's (docs/rollouts.md, "black-box agents over the gateway and MCP"): the
agent talks to the model through its own gateway session and to the episode's tools through an
MCP server (:mod:`.mcp_tools`); corral opens and closes everything around it, has the episode
graded and the reward (or the failure) land on the session. This agent runs on the host
(development only; ``corral play`` makes itself non-dumpable first, :func:`make_undumpable`);
with ``--harness`` the agent runs in the episode's own sandbox instead
(:mod:`corral.rollouts.harness_play`).

What the agent is given, in its environment (the rest of the caller's environment is inherited,
less the env server's token variable and any ``hidden_vars``: the agent reaches the env only
through MCP):

- ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``: its session's OpenAI endpoint and key (the OpenAI
  SDKs read these two by themselves);
- ``CORRAL_MCP_URL``, ``CORRAL_MCP_TOKEN``: the episode's MCP endpoint (streamable HTTP) and the
  bearer token it requires;
- ``CORRAL_TASK_PROMPT``, ``CORRAL_SYSTEM_PROMPT``: the row's user and system messages (the
  system prompt is empty when the row has none); ``CORRAL_TASK_ID``: the task's id.

How a rollout ends (first rule that applies; "failed" means the session is flagged failed with
the reason, never rewarded 0):

1. the episode could not be opened on the env server: failed, the agent is not started;
2. the env failed during the agent's play (an env error, a tool call past its deadline, the
   server gone): failed;
3. the agent did not exit within ``timeout_s``: its process group gets SIGTERM, then SIGKILL
   after ``kill_grace_s``; failed, even if the episode had already been graded (the session may
   hold a model call cut short);
4. the agent exited non-zero: failed, the reason carries the tail of its stderr;
5. the session recorded no model turn: failed (the agent did not use its session, so there is
   nothing to train on; most likely it talked to another endpoint);
6. otherwise, when the episode is still running it is ended with ``end_turn`` (repeated while
   the env hands out further turns) and graded. An agent that stopped without calling a tool
   is graded like any other: it played badly, and the verifier says how badly (gridsim: 0);
7. a graded episode's reward is set on the session; an episode that ended without a reward
   (the verifier or the reward function failed) is failed with the env's error.

Cancellation (the caller's task cancelled) kills the agent's process group, stops the MCP
server, closes the episode and deletes the session before the cancellation goes on.

With a trace sink (``trace``, :mod:`corral.rollouts.traces`) each episode's spans go to it
when it ends: ``episode`` (attrs: reward, failed, reason, turns, tool calls), and under it
``session_open``, ``env_reset``, ``agent`` (the process: exit code, timed out, tool calls) and
``grading`` (rules 5-7: the episode ended and graded, the outcome set on the session).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shlex
import signal
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.envs.client import EnvClient, EnvClientError
from corral.gateway.client import GatewayAdmin, GatewayAdminError, SessionCreated
from corral.rollouts.evals import Stats
from corral.rollouts.rows import Row
from corral.rollouts.traces import EpisodeTrace, JsonScalar, TraceSink
from corral.samples import Sample

if TYPE_CHECKING:  # the MCP SDK is imported when a rollout runs, not with the CLI
    from corral.adapters.mcp_tools import EpisodeTools, McpEndpoint

# The most end_turn calls spent ending an episode the agent left running: one suffices for an
# env without turns; a multi-turn env ends at its own max_turns well before this.
MAX_CLOSING_TURNS = 64
# Bytes of the agent's stdout / stderr kept for the rollout's report.
TAIL_BYTES = 4000
# How long the agent's pipes may stay open after its process group was killed (a process that
# left the group can hold them); past it the readers are cancelled.
PIPE_DRAIN_S = 2.0


class AgentConfigError(ValueError):
    """The rollout cannot start as configured (an empty command, a token variable unset)."""


@dataclass(frozen=True)
class AgentExit:
    """How the agent's process ended: ``exit_code`` is ``None`` when it was killed after its
    timeout (``timed_out``); the tails are the last :data:`TAIL_BYTES` of each stream."""

    exit_code: int | None
    timed_out: bool
    stdout_tail: str
    stderr_tail: str


@dataclass
class AgentRollout:
    """One row played by a black-box agent.

    ``reward`` is the env's reward when the episode was graded (it is reported even for a
    failed rollout, e.g. an agent that submitted and then crashed; such a reward is NOT set on
    the session). ``failed`` with ``reason`` is what was flagged on the session. ``turns``:
    model turns the session recorded; ``tool_calls``: the agent's calls forwarded to the env
    (corral's own closing ``end_turn`` not counted). ``samples``: the session's samples, taken
    after the reward or failure was set.
    """

    task_id: str
    split: str
    index: int
    session_id: str | None
    reward: float | None = None
    failed: bool = False
    reason: str | None = None
    status: str = "not_started"
    scores: dict[str, float] | None = None
    turns: int = 0
    tool_calls: int = 0
    agent_exit_code: int | None = None
    agent_stderr: str = ""
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0

    def fail(self, reason: str) -> None:
        """Flag this rollout failed; the first reason wins (later ones are consequences)."""
        if not self.failed:
            self.failed, self.reason = True, reason

    def summary(self) -> dict[str, Any]:
        """The JSON line ``corral play`` writes for this episode (samples counted, not kept)."""
        return {
            "task_id": self.task_id,
            "split": self.split,
            "index": self.index,
            "session_id": self.session_id,
            "reward": self.reward,
            "failed": self.failed,
            "reason": self.reason,
            "status": self.status,
            "scores": self.scores,
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "agent_exit_code": self.agent_exit_code,
            "agent_stderr": self.agent_stderr[-2000:],
            "samples": len(self.samples),
            "seconds": round(self.seconds, 3),
        }


def agent_argv(agent_cmd: str | Sequence[str]) -> list[str]:
    """The agent's argv: a string is split like a shell would (no shell runs it)."""
    argv = shlex.split(agent_cmd) if isinstance(agent_cmd, str) else list(agent_cmd)
    if not argv:
        raise AgentConfigError("the agent command is empty")
    return argv


def env_token(row: Row, environ: Mapping[str, str]) -> str | None:
    """The env server's token for ``row``, from the variable the row names (``None`` when it
    names none). Raises :class:`AgentConfigError` when the variable is unset or empty."""
    var = row.metadata.env.token_var
    if var is None:
        return None
    token = environ.get(var)
    if not token:
        raise AgentConfigError(
            f"row {row.metadata.task_id} names the env token variable {var}, which is not set"
        )
    return token


def _prompt(row: Row, role: str) -> str:
    return next((m["content"] for m in row.messages if m.get("role") == role), "")


def agent_environment(
    row: Row,
    session: SessionCreated,
    endpoint: McpEndpoint,
    environ: Mapping[str, str],
    hidden_vars: Collection[str] = (),
) -> dict[str, str]:
    """The agent's environment: ``environ`` less the env token variable and ``hidden_vars``,
    plus the session, MCP endpoint and prompts (see the module docstring)."""
    hidden = set(hidden_vars)
    if row.metadata.env.token_var:
        hidden.add(row.metadata.env.token_var)
    agent_env = {k: v for k, v in environ.items() if k not in hidden}
    agent_env.update(
        OPENAI_BASE_URL=session.base_url,
        OPENAI_API_KEY=session.api_key,
        CORRAL_MCP_URL=endpoint.url,
        CORRAL_MCP_TOKEN=endpoint.token,
        CORRAL_TASK_PROMPT=_prompt(row, "user"),
        CORRAL_SYSTEM_PROMPT=_prompt(row, "system"),
        CORRAL_TASK_ID=row.metadata.task_id,
    )
    return agent_env


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    # The group may be gone already (everything in it exited): nothing to do then.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _keep_tail(stream: asyncio.StreamReader | None, tail: collections.deque[bytes]) -> None:
    """Read ``stream`` to its end (so the agent never blocks on a full pipe), keeping the last
    :data:`TAIL_BYTES` bytes in ``tail``."""
    if stream is None:
        return
    kept = 0
    while chunk := await stream.read(65536):
        tail.append(chunk)
        kept += len(chunk)
        while kept - len(tail[0]) >= TAIL_BYTES:
            kept -= len(tail.popleft())


def _text(tail: collections.deque[bytes]) -> str:
    return b"".join(tail)[-TAIL_BYTES:].decode("utf-8", "replace")


async def run_agent(
    argv: Sequence[str],
    environ: Mapping[str, str],
    *,
    timeout_s: float,
    kill_grace_s: float = 5.0,
    cwd: Path | None = None,
) -> AgentExit:
    """Run the agent in a process group of its own until it exits or ``timeout_s`` passes.

    On the timeout the group gets SIGTERM, then SIGKILL after ``kill_grace_s``. Whatever is
    left of the group once the agent's main process ended (stray children) is killed too, in
    every case, cancellation included. Returns once the agent is reaped and its output pipes
    are closed, i.e. every process that inherited them has exited (pipes a process outside the
    group still holds are abandoned after :data:`PIPE_DRAIN_S`). Raises ``OSError`` when the
    command cannot be started.
    """
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=dict(environ),
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its own session and process group: killed as a whole
    )
    pgid = proc.pid
    out: collections.deque[bytes] = collections.deque()
    err: collections.deque[bytes] = collections.deque()
    readers = [
        asyncio.create_task(_keep_tail(proc.stdout, out)),
        asyncio.create_task(_keep_tail(proc.stderr, err)),
    ]
    timed_out = False
    try:
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            timed_out = True
            _signal_group(pgid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(kill_grace_s):
                    await proc.wait()
    finally:
        _signal_group(pgid, signal.SIGKILL)
        await proc.wait()
        _, pending = await asyncio.wait(readers, timeout=PIPE_DRAIN_S)
        for reader in pending:
            reader.cancel()
    return AgentExit(
        exit_code=None if timed_out else proc.returncode,
        timed_out=timed_out,
        stdout_tail=_text(out),
        stderr_tail=_text(err),
    )


async def play_with_agent(
    row: Row,
    *,
    gateway: GatewayAdmin,
    agent_cmd: str | Sequence[str],
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    hidden_vars: Collection[str] = (),
    kill_grace_s: float = 5.0,
    sampling: dict[str, Any] | None = None,
    group_index: int | None = None,
    cwd: Path | None = None,
    trace: TraceSink | None = None,
) -> AgentRollout:
    """Play ``row`` with the agent command ``agent_cmd`` (see the module docstring for what the
    agent gets and how the rollout ends).

    ``env`` (default ``os.environ``) is where the env token is read from and what the agent
    inherits; ``sampling`` overrides go to the session (they win over the agent's values);
    ``trace``: where the episode's spans go (``None``: nothing is recorded).

    Every failure of the agent or the env comes back as a failed :class:`AgentRollout` whose
    reason is also flagged on the session. Raises :class:`AgentConfigError` before anything
    starts when the command is empty or the row's token variable is unset, and
    :class:`GatewayAdminError` when the gateway refuses or cannot be reached (then nothing
    could be recorded; whatever was opened is closed first).
    """
    environ = os.environ if env is None else env
    argv = agent_argv(agent_cmd)
    token = env_token(row, environ)
    meta = row.metadata
    started = time.monotonic()
    spans = EpisodeTrace(task_id=meta.task_id, attempt=0) if trace is not None else None
    opened = time.time()
    session = await gateway.open_session(
        metadata={
            "task_id": meta.task_id,
            "split": meta.split,
            "index": meta.index,
            "agent": shlex.join(argv),
        },
        group_index=group_index,
        sampling=sampling,
    )
    if spans is not None:
        spans.session_id = session.id
        spans.add("session_open", opened, time.time())
    rollout = AgentRollout(meta.task_id, meta.split, meta.index, session.id)
    client = EnvClient(
        meta.env.url, token, timeout=meta.env.tool_timeout, reset_timeout=meta.env.reset_timeout
    )
    try:
        from corral.adapters.mcp_tools import EpisodeTools

        tools = EpisodeTools(client, meta.tools)
        reset_at = time.time()
        try:
            await client.reset(split=meta.split, index=meta.index)
            rollout.status = "running"
        except EnvClientError as exc:
            rollout.fail(f"the episode could not be opened on {meta.env.url}: {exc}")
        if spans is not None:
            spans.add("env_reset", reset_at, time.time(), error=rollout.reason)
        if not rollout.failed:
            agent_at = time.time()
            ended = await _run_agent_on_episode(
                rollout,
                row,
                session,
                tools,
                argv,
                environ,
                hidden_vars,
                timeout_s,
                kill_grace_s,
                cwd,
            )
            if spans is not None:
                spans.add(
                    "agent", agent_at, time.time(), exit_code=rollout.agent_exit_code,
                    timed_out=ended is not None and ended.timed_out,
                    tool_calls=rollout.tool_calls, error=rollout.reason,
                )  # fmt: skip
        graded_at = time.time()
        await _settle(rollout, gateway, session, tools)
        if spans is not None:
            spans.add("grading", graded_at, time.time(), reward=rollout.reward,
                      status=rollout.status)  # fmt: skip
        rollout.samples = await gateway.samples(session.id)
    finally:
        await client.close()
        # The gateway reaps an idle session after its TTL anyway: a failed delete must not
        # hide the rollout's own outcome or error.
        with contextlib.suppress(GatewayAdminError):
            await gateway.close_session(session.id)
        rollout.seconds = time.monotonic() - started
        if trace is not None and spans is not None:
            trace.write(spans.spans(_episode_attrs(rollout)))
    return rollout


def _episode_attrs(rollout: AgentRollout) -> dict[str, JsonScalar]:
    """The ``episode`` span's attrs (a rollout cut short, cancelled, shows what it got to)."""
    attrs: dict[str, JsonScalar] = {
        "reward": rollout.reward,
        "failed": rollout.failed,
        "reason": rollout.reason,
        "status": rollout.status,
        "turns": rollout.turns,
        "tool_calls": rollout.tool_calls,
    }
    attrs.update({f"score.{k}": v for k, v in (rollout.scores or {}).items()})
    return attrs


async def _run_agent_on_episode(
    rollout: AgentRollout,
    row: Row,
    session: SessionCreated,
    tools: EpisodeTools,
    argv: list[str],
    environ: Mapping[str, str],
    hidden_vars: Collection[str],
    timeout_s: float,
    kill_grace_s: float,
    cwd: Path | None,
) -> AgentExit | None:
    """Serve the episode's tools, run the agent to its end, and record rules 2-4; how the
    agent ended (``None``: it could not be started)."""
    from corral.adapters.mcp_tools import serve_episode_tools

    async with serve_episode_tools(tools) as endpoint:
        agent_env = agent_environment(row, session, endpoint, environ, hidden_vars)
        try:
            ended = await run_agent(
                argv, agent_env, timeout_s=timeout_s, kill_grace_s=kill_grace_s, cwd=cwd
            )
        except OSError as exc:
            rollout.fail(f"the agent command {shlex.join(argv)!r} could not be started: {exc}")
            return None
    rollout.tool_calls = tools.calls
    rollout.agent_exit_code = ended.exit_code
    rollout.agent_stderr = ended.stderr_tail
    if tools.failure is not None:
        rollout.fail(f"the env failed: {tools.failure}")
    if ended.timed_out:
        rollout.fail(f"the agent did not exit within {timeout_s:g} s and was killed")
    elif ended.exit_code != 0:
        tail = ended.stderr_tail.strip()[-1000:] or "(no stderr)"
        rollout.fail(f"the agent exited with code {ended.exit_code}; stderr tail:\n{tail}")
    return ended


async def _settle(
    rollout: AgentRollout, gateway: GatewayAdmin, session: SessionCreated, tools: EpisodeTools
) -> None:
    """Rules 5-7: end and grade the episode when all went well, then set the reward on the
    session or flag it failed."""
    view = await gateway.view(session.id)
    rollout.turns = len(view.get("turns", []))
    if not rollout.failed and rollout.turns == 0:
        rollout.fail("the session recorded no model turn: the agent never called its model")
    if not rollout.failed:
        await tools.end(MAX_CLOSING_TURNS)
        if tools.failure is not None:
            rollout.fail(f"the env failed while the episode was ended: {tools.failure}")
    outcome = tools.outcome
    if outcome is not None:
        rollout.status = outcome.observation.status
        rollout.reward = outcome.reward
        rollout.scores = outcome.observation.scores
        if outcome.reward is None:
            why = outcome.observation.grade_error or "no reason given"
            rollout.fail(f"the episode ended without a reward: {why}")
    elif tools.failure is not None:
        rollout.status = "error"
    if rollout.failed:
        assert rollout.reason is not None
        await gateway.fail(session.id, rollout.reason)
    else:
        assert rollout.reward is not None  # not failed: graded with a reward
        await gateway.set_reward(session.id, rollout.reward)


async def play_rows_with_agent(
    rows: Sequence[Row],
    *,
    gateway: GatewayAdmin,
    agent_cmd: str | Sequence[str],
    concurrency: int = 4,
    on_done: Callable[[AgentRollout], None] | None = None,
    **play: Any,
) -> list[AgentRollout]:
    """Play every row, at most ``concurrency`` at once; the rollouts in row order.

    ``play`` goes to :func:`play_with_agent`. A row whose gateway calls fail comes back as a
    failed rollout (``session_id`` ``None`` when no session was opened) so that the other rows
    go on; :class:`AgentConfigError` is raised before any row starts. ``on_done`` is called
    with each rollout as it finishes. Cancelling cancels every row (each closes what it
    opened).
    """
    if concurrency < 1:
        raise AgentConfigError("concurrency must be at least 1")
    agent_argv(agent_cmd)
    environ = play.get("env") or os.environ
    for row in rows:
        env_token(row, environ)
    room = asyncio.Semaphore(concurrency)

    async def one(row: Row) -> AgentRollout:
        async with room:
            try:
                rollout = await play_with_agent(row, gateway=gateway, agent_cmd=agent_cmd, **play)
            except GatewayAdminError as exc:
                meta = row.metadata
                rollout = AgentRollout(meta.task_id, meta.split, meta.index, None)
                rollout.fail(f"the gateway failed: {exc}")
        if on_done is not None:
            on_done(rollout)
        return rollout

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(row)) for row in rows]
    return [task.result() for task in tasks]


def summarize(rollouts: Sequence[AgentRollout]) -> Stats:
    """Failed episodes are left out of the mean, not counted as 0: a failure says nothing
    about how well the agent plays."""
    return Stats.of([None if r.failed else r.reward for r in rollouts])


def write_play_outputs(out: Path, rollouts: Sequence[AgentRollout]) -> Stats:
    """``episodes.jsonl`` (one :meth:`AgentRollout.summary` a line), ``samples.jsonl`` and
    ``summary.json`` (:func:`summarize`) under ``out``; the summary."""
    summary = summarize(rollouts)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "episodes.jsonl").open("w") as episodes:
        for rollout in rollouts:
            episodes.write(json.dumps(rollout.summary()) + "\n")
    with (out / "samples.jsonl").open("w") as samples:
        for rollout in rollouts:
            for sample in rollout.samples:
                samples.write(sample.model_dump_json() + "\n")
    (out / "summary.json").write_text(summary.model_dump_json(indent=2) + "\n")
    return summary


def make_undumpable() -> bool:
    """Mark this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so that a process of
    another uid, or one of this uid without ``CAP_SYS_PTRACE``, can neither ptrace it nor read
    its ``/proc/<pid>/environ`` (where the admin and env tokens are): the host-mode agents run
    beside it. The agents themselves are not affected (``execve`` makes them dumpable again).
    Returns whether it worked (False off Linux or where prctl is refused)."""
    import ctypes
    import ctypes.util

    pr_set_dumpable = 4
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(pr_set_dumpable, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
