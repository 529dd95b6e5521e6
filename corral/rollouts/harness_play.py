"""Rollouts through a harness: a black-box agent (Claude Code, Codex CLI, any command) plays a
row *inside the episode's own sandbox*, graded on the workspace it leaves.

:class:`HarnessPlayer` has the :class:`~corral.rollouts.player.Player`'s interface (an async
context manager; :meth:`HarnessPlayer.play` returns a :class:`~corral.rollouts.player.Rollout`),
so :class:`~corral.trainer.rollouts.GroupDraw`, ``Group.from_player`` and
:func:`~corral.rollouts.evals.run_eval` take it unchanged. One rollout:

1. a gateway session is opened (metadata: task, split, index, harness) while the row's episode
   starts on its env server (a full or restarting server is waited for within the row's
   ``reset_timeout``, as the player does);
2. the harness turns the task's prompt, the bundle's ``[agent] instructions`` and the session
   into an :class:`~corral.envs.protocol.AgentLaunch`; the env server runs it in the episode's
   sandbox, bridging the agent's traffic to the gateway, then ends and grades the episode
   (:meth:`~corral.envs.client.EnvClient.run_agent`);
3. the outcome is set on the session (the reward, or the failure with its reason) and the
   session's samples are taken; the session is closed.

Failure is explicit, never a reward of 0 (first rule that applies):

- the env server refused the launch or failed (``env: ...``);
- the agent did not exit within its budget, or the sandbox killed it (``agent: ...``);
- the agent exited non-zero (``agent: exited with code N``, with its stderr tail);
- the session recorded no model turn (``agent: ... no model turn``: nothing to train on);
- the episode was not graded (``no reward: <grade_error>``);
- the gateway could not take the outcome or hand over the samples (``gateway: ...``).

Everything the agent did is kept on the rollout (:class:`HarnessRollout`): its
:class:`~corral.envs.protocol.AgentRun` (exit, tails, transcript) and the rollout's marks in
time (:class:`HarnessMarks`). With a trace sink (:mod:`corral.rollouts.traces`) each episode's spans
go to it when it ends: ``episode`` (attrs: reward, failed, reason, turns), and under it
``session_open``, ``env_reset``, ``agent`` (the agent's process, from the env server's
:class:`~corral.envs.protocol.AgentRun` times placed on this host's clock from when the launch
was sent; attrs: exit code, timed out, killed reason, gateway connections), with its child
``first_model_request`` (the agent's start to its first gateway connection), and ``grading``
(the env server ending and grading the episode after the agent). :func:`add_harness_arguments`
adds the command-line flags that make
a :class:`HarnessOptions` (``corral play``, ``corral eval``; read back by the CLI).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from corral.envs.client import EnvClient, EnvClientError, EnvServerError
from corral.envs.protocol import AgentLaunch, AgentResult, AgentRun, ResetObservation
from corral.gateway.client import GatewayAdmin, GatewayAdminError, SessionCreated
from corral.harnesses import HARNESSES
from corral.harnesses.base import AgentTask, Harness, HarnessError, SessionAccess
from corral.rollouts.player import (
    PlayerError,
    Rollout,
    RolloutFailed,
    RolloutTiming,
    row_token,
    settle_session,
    start_episode,
)
from corral.rollouts.rows import Row
from corral.rollouts.traces import EpisodeTrace, JsonScalar, TraceSink

if TYPE_CHECKING:
    from corral.rollouts.evals import Stats


class _Failed(Exception):
    """Internal: the rollout failed with this reason."""


@dataclass(frozen=True)
class HarnessMarks:
    """Where one harness rollout's time went, for the benchmark. ``started_at``: wall clock
    (``time.time()``) when the rollout began; the rest are seconds since then:
    ``launched_s`` when the agent frame went to the env server, ``reward_set_s`` when the
    outcome was set on the session (``None``: it could not be). ``first_request_s`` and
    ``agent_s`` are the env server's own :class:`~corral.envs.protocol.AgentRun` times
    (seconds since it took the launch): the agent's first gateway connection and its end."""

    started_at: float
    launched_s: float | None = None
    first_request_s: float | None = None
    agent_s: float | None = None
    reward_set_s: float | None = None


@dataclass(frozen=True)
class HarnessRollout(Rollout):
    """A :class:`~corral.rollouts.player.Rollout` played by a harness, with the agent's
    ``run`` (``None`` when it never ran: the episode did not start, or the server refused the
    launch), the ``harness`` name and the rollout's ``marks``. ``turns`` counts the model turns
    the session recorded; ``messages`` are the row's (the agent's own conversation is in its
    ``run.transcript`` and in the samples)."""

    harness: str = ""
    run: AgentRun | None = None
    marks: HarnessMarks = field(default_factory=lambda: HarnessMarks(started_at=0.0))

    @property
    def transcript(self) -> str:
        return self.run.transcript if self.run is not None else ""


@dataclass(frozen=True)
class HarnessOptions:
    """How a :class:`HarnessPlayer` is made: the ``harness``, the agent's budget
    ``timeout_s``, the ``model`` name it asks the gateway for, and ``sandbox_gateway``: the
    gateway's origin as the env server reaches it (``None``: the admin URL's origin)."""

    harness: Harness
    timeout_s: float
    model: str = "corral"
    sandbox_gateway: str | None = None


def origin(url: str) -> str:
    """``scheme://host:port`` of ``url`` (what an :class:`AgentLaunch` names the gateway by).
    ValueError for a URL without scheme and host."""
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s) URL")
    return f"{parts.scheme}://{parts.netloc}"


def session_path(session: SessionCreated) -> str:
    """The session's path on the gateway, ``/sessions/<id>`` (its OpenAI base URL less
    ``/v1``): the harness appends what its agent's API needs."""
    path = urlsplit(session.base_url).path.rstrip("/")
    return path.removesuffix("/v1")


class HarnessPlayer:
    """Plays rows with ``harness`` in each episode's sandbox (module docstring). ``sampling``
    overrides every session's sampling; ``env`` is where a row's token variable is looked up
    (default ``os.environ``); ``trace``, where every episode's spans go (``None``: nothing is
    recorded). ValueError for a non-positive budget or a bad gateway origin."""

    def __init__(
        self,
        gateway: GatewayAdmin,
        harness: Harness,
        *,
        timeout_s: float,
        model: str = "corral",
        sandbox_gateway: str | None = None,
        sampling: dict[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        trace: TraceSink | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("the agent's timeout must be positive")
        self.gateway = gateway
        self.harness = harness
        self.timeout_s = timeout_s
        self.model = model
        self.sandbox_gateway = origin(sandbox_gateway or gateway.url)
        self.sampling = dict(sampling or {})
        self.env = env if env is not None else os.environ
        self.trace = trace
        self._guarded: asyncio.Task[None] | None = None

    @classmethod
    def of(
        cls,
        gateway: GatewayAdmin,
        options: HarnessOptions,
        *,
        sampling: dict[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        trace: TraceSink | None = None,
    ) -> HarnessPlayer:
        """The player ``options`` describe."""
        return cls(
            gateway,
            options.harness,
            timeout_s=options.timeout_s,
            model=options.model,
            sandbox_gateway=options.sandbox_gateway,
            sampling=sampling,
            env=env,
            trace=trace,
        )

    async def aclose(self) -> None:
        """Nothing of its own to close (the gateway admin client is the caller's)."""

    async def __aenter__(self) -> HarnessPlayer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _guard(self) -> None:
        """Refuse a gateway that takes admin calls without a token: through its session's
        URL the agent reaches the gateway's admin routes too, and could set its own reward.
        Checked once, before the first rollout."""
        if self._guarded is None:
            self._guarded = asyncio.ensure_future(self._check_admin())
        await asyncio.shield(self._guarded)

    async def _check_admin(self) -> None:
        try:
            closed = await self.gateway.admin_needs_token()
        except GatewayAdminError as exc:
            raise PlayerError(str(exc)) from exc
        if not closed:
            raise PlayerError(
                f"the gateway at {self.gateway.url} takes admin calls without a token: an agent "
                "could set its own reward through its session's URL. Start it with an admin "
                "token (corral gateway --admin-token-var NAME) and pass the same variable here"
            )

    def _token(self, row: Row) -> str | None:
        return row_token(row, self.env)

    async def play(
        self,
        row: Row | dict[str, Any],
        *,
        group_index: int | None = None,
        index: int | None = None,
        metadata: dict[str, Any] | None = None,
        sampling: dict[str, Any] | None = None,
        trace: TraceSink | None = None,
    ) -> HarnessRollout:
        """Play ``row`` once (module docstring for what fails and how); ``trace``, the
        player's sink for this episode's spans. :class:`PlayerError` for a row that cannot be
        played at all (not a row, its token variable unset, a gateway that opens no session, a
        harness that cannot launch this task)."""
        started, started_at = time.monotonic(), time.time()
        try:
            row = row if isinstance(row, Row) else Row.model_validate(row)
        except ValueError as exc:
            raise PlayerError(f"not a corral row: {exc}") from exc
        token = self._token(row)
        await self._guard()
        meta, ref = row.metadata, row.metadata.env
        tags = {"task_id": meta.task_id, "split": meta.split, "index": meta.index}
        sink = trace if trace is not None else self.trace
        spans = EpisodeTrace(task_id=meta.task_id, attempt=index) if sink is not None else None
        client = EnvClient(
            ref.url, token, timeout=ref.tool_timeout + 5.0, reset_timeout=ref.reset_timeout + 5.0
        )
        reset = asyncio.ensure_future(_reset(client, row, spans))
        try:
            opened = time.time()
            session = await self.gateway.open_session(
                metadata={**tags, "harness": self.harness.name, **(metadata or {})},
                group_index=group_index,
                index=index,
                sampling={**self.sampling, **(sampling or {})},
            )
            if spans is not None:
                spans.session_id = session.id
                spans.add("session_open", opened, time.time())
        except BaseException as exc:
            reset.cancel()
            with contextlib.suppress(BaseException):
                await reset
            await asyncio.shield(client.close())
            if isinstance(exc, GatewayAdminError):
                raise PlayerError(f"the gateway opened no session: {exc}") from exc
            raise
        outcome = _Outcome()
        reward_set_s: float | None = None
        launched_s: float | None = None
        reason: str | None = None
        try:
            try:
                launch = await self._launch(session, reset)
                launched_s = time.monotonic() - started
                # What the server may take to end and grade the episode after the agent: the
                # finish tool, then end_turn calls up to the row's max_turns.
                finish_s = (ref.max_turns + 1) * (ref.tool_timeout + 5.0)
                sent = time.time()
                try:
                    outcome.result = await self._run(client, launch, finish_s)
                finally:
                    if spans is not None:
                        _trace_agent(spans, sent, time.time(), outcome.result)
                outcome.judge(self.timeout_s, await self._turns(session.id))
            except _Failed as exc:
                outcome.fail(str(exc))
            finally:
                if not reset.done():
                    reset.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.shield(client.close())
            samples, reason = await settle_session(
                self.gateway, session.id, outcome.reward, outcome.reason, tags, group_index, index
            )
            if reason is None:
                reward_set_s = time.monotonic() - started
        except BaseException as exc:  # for the trace only: the error goes on
            if reason is None:
                cancelled = isinstance(exc, asyncio.CancelledError)
                reason = "cancelled" if cancelled else f"{type(exc).__name__}: {exc}"
            raise
        finally:
            # Shielded: a cancelled rollout still deletes its session (and never leaks it).
            with contextlib.suppress(GatewayAdminError):
                await asyncio.shield(self.gateway.close_session(session.id))
            if sink is not None and spans is not None:
                attrs: dict[str, JsonScalar] = {
                    "reward": None if reason else outcome.reward,
                    "failed": reason is not None,
                    "reason": reason,
                    "turns": outcome.turns,
                    "harness": self.harness.name,
                }
                sink.write(spans.spans(attrs))
        total = time.monotonic() - started
        run = outcome.result.run if outcome.result is not None else None
        agent_s = run.seconds if run is not None else 0.0
        return HarnessRollout(
            row=row,
            session_id=session.id,
            samples=samples,
            reward=None if reason else outcome.reward,
            failed=reason is not None,
            reason=reason,
            scores=dict(outcome.result.scores or {}) if outcome.result is not None else {},
            turns=outcome.turns,
            messages=[dict(m) for m in row.messages],
            # The agent's whole run counts as "model" time (its tools ran inside it); "tools" is
            # the rest: starting the episode, ending and grading it, the session's admin calls.
            timing=RolloutTiming(agent_s, max(total - agent_s, 0.0), total),
            harness=self.harness.name,
            run=run,
            marks=HarnessMarks(
                started_at=started_at,
                launched_s=launched_s,
                first_request_s=run.first_request_s if run is not None else None,
                agent_s=run.seconds if run is not None else None,
                reward_set_s=reward_set_s,
            ),
        )

    async def _launch(
        self, session: SessionCreated, reset: asyncio.Future[StartedEpisode]
    ) -> AgentLaunch:
        """The agent's launch once the episode has started; :class:`PlayerError` when the
        harness cannot launch it (a configuration problem), ``_Failed`` when the episode did
        not start."""
        started = await reset
        task = AgentTask(
            prompt=started.prompt, instructions=started.instructions, task_id=started.task_id
        )
        try:
            access = SessionAccess(
                gateway=self.sandbox_gateway,
                session_path=session_path(session),
                api_key=session.api_key,
                model=self.model,
            )
            return self.harness.launch(task, access, timeout_s=self.timeout_s)
        except HarnessError as exc:
            raise PlayerError(f"the {self.harness.name} harness cannot launch: {exc}") from exc

    async def _run(self, client: EnvClient, launch: AgentLaunch, finish_s: float) -> AgentResult:
        try:
            result: AgentResult = await client.run_agent(launch, finish_timeout=finish_s)
        except EnvServerError as exc:
            raise _Failed(f"env: the agent was not run: {exc}") from exc
        except EnvClientError as exc:
            raise _Failed(f"env: {exc}") from exc
        return result

    async def _turns(self, session_id: str) -> int:
        """Model turns the session recorded (``_Failed`` when the gateway cannot say)."""
        try:
            view = await self.gateway.view(session_id)
        except GatewayAdminError as exc:
            raise _Failed(f"gateway: {exc}") from exc
        return len(view.get("turns") or [])


@dataclass
class _Outcome:
    """What a harness rollout learned: the env server's result, the session's turn count, and
    the first failure (later ones are consequences)."""

    result: AgentResult | None = None
    turns: int = 0
    reason: str | None = None

    @property
    def reward(self) -> float | None:
        return self.result.reward if self.result is not None else None

    def fail(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def judge(self, timeout_s: float, turns: int) -> None:
        """The rules on a finished agent run (module docstring), in order."""
        self.turns = turns
        assert self.result is not None
        run = self.result.run
        if run.timed_out:
            self.fail(f"agent: did not exit within {timeout_s:g} s and was killed")
        elif run.exit_code is None:
            self.fail(f"agent: killed: {run.killed_reason or 'no reason given'}")
        elif run.exit_code != 0:
            tail = run.stderr_tail.strip()[-1000:] or "(no stderr)"
            self.fail(f"agent: exited with code {run.exit_code}; stderr tail:\n{tail}")
        elif turns == 0:
            self.fail("agent: the session recorded no model turn (it never called its model)")
        elif self.result.status != "graded" or self.result.reward is None:
            self.fail(f"no reward: {self.result.grade_error or 'the episode was not graded'}")


@dataclass(frozen=True)
class StartedEpisode:
    """What a harness needs of a started episode: its prompt, id and the bundle's
    ``[agent] instructions`` (empty when it has none)."""

    prompt: str
    task_id: str
    instructions: str

    @classmethod
    def of(cls, observation: ResetObservation) -> StartedEpisode:
        instructions = observation.agent_instructions or ""
        return cls(observation.prompt, observation.task_id, instructions)


async def _reset(client: EnvClient, row: Row, spans: EpisodeTrace | None) -> StartedEpisode:
    """Start the row's episode (as the player does); ``_Failed`` when it does not start."""
    with contextlib.nullcontext() if spans is None else spans.span("env_reset"):
        try:
            return StartedEpisode.of(await start_episode(client, row))
        except RolloutFailed as exc:
            raise _Failed(str(exc)) from exc


def _trace_agent(spans: EpisodeTrace, sent: float, back: float, result: AgentResult | None) -> None:
    """The ``agent``, ``first_model_request`` and ``grading`` spans of the env server's run
    of the agent, sent at ``sent`` and answered at ``back`` (wall clock). The run's own times
    are seconds since the server took the launch: placed from ``sent`` (the frame's transit
    is the error), kept within ``[sent, back]``."""
    if result is None:  # the server refused the launch or failed: only the call's time
        spans.add("agent", sent, back, error="the agent was not run")
        return
    run = result.run

    def at(offset: float | None) -> float:
        return min(max(sent + (offset or 0.0), sent), back)

    start, end = at(run.started_s), at(run.seconds)
    spans.add(
        "agent",
        start,
        end,
        exit_code=run.exit_code,
        timed_out=run.timed_out,
        killed_reason=run.killed_reason,
        gateway_connections=run.gateway_connections,
        first_request_s=run.first_request_s,
    )
    if run.first_request_s is not None:
        spans.add("first_model_request", start, at(run.first_request_s), parent="agent")
    spans.add(
        "grading", end, back, status=result.status, reward=result.reward,
        grade_error=result.grade_error,
    )  # fmt: skip


# -- outputs ---------------------------------------------------------------------------------


def agent_summary(rollout: Rollout) -> dict[str, Any] | None:
    """The agent's run as an episode line carries it (no transcript: that goes to its own
    file), or ``None`` for a rollout that is not a harness's or whose agent never ran."""
    if not isinstance(rollout, HarnessRollout) or rollout.run is None:
        return None
    run = rollout.run
    marks = rollout.marks
    return {
        "harness": rollout.harness,
        "exit_code": run.exit_code,
        "timed_out": run.timed_out,
        "killed_reason": run.killed_reason,
        "stderr_tail": run.stderr_tail[-2000:],
        "transcript_truncated": run.transcript_truncated,
        "started_s": run.started_s,
        "first_request_s": run.first_request_s,
        "seconds": run.seconds,
        "gateway_connections": run.gateway_connections,
        "started_at": marks.started_at,
        "launched_s": marks.launched_s,
        "reward_set_s": marks.reward_set_s,
    }


def write_transcript(folder: Path, number: int, transcript: str) -> Path:
    """``folder/<number>.jsonl``: the agent's transcript as it wrote it (a harness picks a
    stream of JSON lines where its agent has one: Claude Code's ``stream-json``, Codex's
    ``--json``); returns the path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{number}.jsonl"
    path.write_text(transcript)
    return path


# -- the command line ------------------------------------------------------------------------


def add_harness_arguments(
    parser: argparse.ArgumentParser, *, agent_cmd: bool = True, timeout: bool = True
) -> None:
    """``--harness``, ``--agent-dir``, ``--model``, ``--sandbox-gateway`` (and, unless the
    command has its own, ``--agent-cmd`` and ``--timeout``): a :class:`HarnessPlayer` plays
    when ``--harness`` is given (the CLI reads them back into :class:`HarnessOptions`)."""
    parser.add_argument(
        "--harness",
        choices=sorted(HARNESSES),
        help="play each episode with this agent inside the episode's sandbox on the env "
        "server (which needs --agent-clis for claude-code and codex)",
    )
    if agent_cmd:
        parser.add_argument(
            "--agent-cmd", help="the command harness's command line (run in the sandbox)"
        )
    parser.add_argument(
        "--agent-dir",
        help="the command harness: a folder of the agent's files, copied into the sandbox "
        "(read-only, at $CORRAL_AGENT_DIR)",
    )
    parser.add_argument(
        "--model",
        default="corral",
        help="the model name the agent asks its gateway session for (default: corral)",
    )
    parser.add_argument(
        "--sandbox-gateway",
        metavar="ORIGIN",
        help="the gateway's origin as the env server reaches it (default: --gateway's)",
    )
    if timeout:
        parser.add_argument(
            "--timeout", type=float, default=600.0, help="seconds the agent may run per episode"
        )


def make_harness(
    name: str,
    *,
    agent_cmd: str | None = None,
    agent_dir: str | Path | None = None,
    settings: Mapping[str, Any] | None = None,
) -> Harness:
    """The harness ``name`` from the registry with ``settings`` (its own: Claude Code's
    ``max_turns``, ``max_retries``, ...) and, for ``command``, ``agent_cmd`` and
    ``agent_dir`` (its ``command`` and ``agent_dir``) when they are set.
    :class:`~corral.harnesses.base.HarnessError` (a ValueError) for an unknown name or
    settings the harness refuses."""
    from corral.harnesses import harness

    options: dict[str, Any] = dict(settings or {})
    if agent_cmd is not None:
        options["command"] = agent_cmd
    if agent_dir is not None:
        options["agent_dir"] = Path(agent_dir)
    return harness(name, **options)


def episode_line(rollout: Rollout) -> dict[str, Any]:
    """One ``episodes.jsonl`` line of ``corral play --harness`` (samples counted, not kept)."""
    meta = rollout.row.metadata
    return {
        "task_id": meta.task_id,
        "split": meta.split,
        "index": meta.index,
        "session_id": rollout.session_id,
        "reward": rollout.reward,
        "failed": rollout.failed,
        "reason": rollout.reason,
        "scores": rollout.scores,
        "turns": rollout.turns,
        "samples": len(rollout.samples),
        "seconds": round(rollout.timing.total_s, 3),
        "agent": agent_summary(rollout),
    }


async def play_rows(
    player: HarnessPlayer,
    rows: Sequence[Row],
    *,
    concurrency: int = 4,
    on_done: Callable[[Rollout], None] | None = None,
) -> list[HarnessRollout]:
    """Play every row once, at most ``concurrency`` at once; the rollouts in row order. A
    :class:`PlayerError` (a row that cannot be played at all) cancels the rest and
    propagates."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    room = asyncio.Semaphore(concurrency)

    async def one(row: Row) -> HarnessRollout:
        async with room:
            rollout = await player.play(row, group_index=row.metadata.index, index=0)
        if on_done is not None:
            on_done(rollout)
        return rollout

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(row)) for row in rows]
    return [task.result() for task in tasks]


def write_play_outputs(out: Path, rollouts: Sequence[HarnessRollout]) -> Stats:
    """``episodes.jsonl``, ``samples.jsonl``, ``summary.json`` and ``transcripts/<n>.jsonl``
    (``n``: the episode's line number, from 0) under ``out``; the summary."""
    from corral.rollouts.evals import Stats

    summary = Stats.of([None if r.failed else r.reward for r in rollouts])
    out.mkdir(parents=True, exist_ok=True)
    with (out / "episodes.jsonl").open("w") as episodes:
        for rollout in rollouts:
            episodes.write(json.dumps(episode_line(rollout)) + "\n")
    with (out / "samples.jsonl").open("w") as samples:
        for rollout in rollouts:
            for sample in rollout.samples:
                samples.write(sample.model_dump_json() + "\n")
    for number, rollout in enumerate(rollouts):
        if rollout.run is not None:
            write_transcript(out / "transcripts", number, rollout.transcript)
    (out / "summary.json").write_text(summary.model_dump_json(indent=2) + "\n")
    return summary
