"""Evals: play a split's rows through the gateway and report the mean reward with its error.

:func:`run_eval` plays every row ``n`` times with the :class:`~corral.rollouts.player.Player`
(at most ``concurrency`` at once) and returns an :class:`EvalReport`: the mean reward over the
graded episodes with its standard error, how many failed (failed episodes are reported, never
averaged in as 0), the share graded exactly 0, and the same per group when the bundle names a
``[eval] group_by`` path into its tasks' data (gridsim: the battery size). :func:`write_eval`
writes every episode (messages, tool calls, scores, failure reason) to ``episodes.jsonl`` and
the report to ``summary.json``.

With a :class:`~corral.rollouts.harness_play.HarnessPlayer` instead (``eval_rows(...,
harness=...)``, ``corral eval --harness``) a black-box agent plays each episode in its
sandbox; each record then carries the agent's run (``agent``: exit, timings) and
:func:`write_eval` writes its transcript to ``transcripts/<n>.jsonl`` (``n``: the record's line
in ``episodes.jsonl``, from 0).

Every episode is traced (:mod:`corral.rollouts.traces`): into the sink ``run_eval(...,
trace=...)`` is given, written as each episode ends (a
:class:`~corral.rollouts.traces.TraceWriter` on the eval's folder), or, without one, into a
bounded buffer on the report that :func:`write_eval` writes to ``traces.jsonl`` beside the
episodes (a caller that learns its folder only at the end: ``corral eval``, a run's evals).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import BaseModel, Field

from corral.gateway.client import GatewayAdmin
from corral.rollouts.harness_play import (
    HarnessOptions,
    HarnessPlayer,
    HarnessRollout,
    agent_summary,
)
from corral.rollouts.player import Player, Rollout
from corral.rollouts.rows import Row
from corral.rollouts.traces import TraceBuffer, TraceSink, TraceWriter

if TYPE_CHECKING:
    from rich.table import Table


class Stats(BaseModel):
    """Rewards of one set of episodes: ``mean`` and ``se`` over the graded ones (``None``
    when none was graded), ``failed`` counted apart, ``zero_share`` of the graded ones."""

    episodes: int
    graded: int
    failed: int
    mean: float | None
    se: float | None
    zero_share: float | None

    @classmethod
    def of(cls, rewards: list[float | None]) -> Stats:
        graded = [r for r in rewards if r is not None]
        mean = statistics.fmean(graded) if graded else None
        se = statistics.stdev(graded) / math.sqrt(len(graded)) if len(graded) > 1 else None
        return cls(
            episodes=len(rewards),
            graded=len(graded),
            failed=len(rewards) - len(graded),
            mean=mean,
            se=se,
            zero_share=sum(r == 0.0 for r in graded) / len(graded) if graded else None,
        )

    def line(self) -> str:
        """``0.797 ± 0.007 (200 graded, 0 failed, 3% graded 0)``."""
        if self.mean is None:
            return f"no episode graded ({self.failed} failed)"
        se = f" ± {self.se:.3f}" if self.se is not None else ""
        zero = f", {self.zero_share:.0%} graded 0" if self.zero_share is not None else ""
        return f"{self.mean:.3f}{se} ({self.graded} graded, {self.failed} failed{zero})"


class EpisodeRecord(BaseModel):
    """One evaluated episode, as written to ``episodes.jsonl``."""

    task_id: str
    split: str
    index: int
    attempt: int
    # The episode's gateway session: what its spans in traces.jsonl are matched by.
    session_id: str | None = None
    group: str | None
    reward: float | None
    failed: bool
    reason: str | None
    scores: dict[str, float]
    turns: int
    tool_calls: int
    messages: list[dict[str, Any]]
    model_s: float
    tools_s: float
    total_s: float
    # A harness's rollout: the agent's run (corral.rollouts.harness_play.agent_summary), and
    # its transcript, written to a file of its own rather than into the line.
    agent: dict[str, Any] | None = None
    transcript: str | None = Field(default=None, exclude=True)

    @classmethod
    def of(cls, rollout: Rollout, attempt: int, group: str | None) -> EpisodeRecord:
        meta = rollout.row.metadata
        calls = sum(len(m.get("tool_calls") or []) for m in rollout.messages)
        return cls(
            task_id=meta.task_id,
            split=meta.split,
            index=meta.index,
            attempt=attempt,
            session_id=rollout.session_id,
            group=group,
            reward=rollout.reward,
            failed=rollout.failed,
            reason=rollout.reason,
            scores=rollout.scores,
            turns=rollout.turns,
            tool_calls=calls,
            messages=rollout.messages,
            model_s=rollout.timing.model_s,
            tools_s=rollout.timing.tools_s,
            total_s=rollout.timing.total_s,
            agent=agent_summary(rollout),
            transcript=(
                rollout.transcript
                if isinstance(rollout, HarnessRollout) and rollout.run is not None
                else None
            ),
        )


class EvalReport(BaseModel):
    """``traces``: the episodes' ``traces.jsonl`` text when :func:`run_eval` kept it (no
    sink was given), one chunk per episode; :func:`write_eval` writes it."""

    overall: Stats
    group_by: str | None
    groups: dict[str, Stats]
    episodes: list[EpisodeRecord]
    traces: list[str] = Field(default_factory=list, exclude=True)


def _dig(data: Any, path: str) -> Any:
    for key in path.split("."):
        data = data.get(key) if isinstance(data, Mapping) else None
    return data


def task_groups(rows: list[Row], token: str | None = None) -> tuple[str | None, dict[str, str]]:
    """The bundle's ``group_by`` path and each task id's group, read from the rows' env
    servers' task API (``{}`` when the bundle names no grouping)."""
    groups: dict[str, str] = {}
    group_by: str | None = None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    by_server: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_server[row.metadata.env.url].append(row)
    for url, served in by_server.items():
        with httpx.Client(base_url=url, headers=headers, timeout=30.0) as http:
            group_by = http.get("/splits").raise_for_status().json().get("group_by")
            if group_by is None:
                continue
            for row in served:
                meta = row.metadata
                task = http.get(f"/tasks/{meta.split}/{meta.index}").raise_for_status().json()
                groups[meta.task_id] = str(_dig(task.get("data"), group_by))
    return group_by, groups


async def run_eval(
    rows: list[Row],
    player: Player | HarnessPlayer,
    *,
    n: int = 1,
    concurrency: int = 8,
    groups: Mapping[str, str] | None = None,
    group_by: str | None = None,
    on_episode: Callable[[EpisodeRecord], None] | None = None,
    trace: TraceSink | None = None,
) -> EvalReport:
    """Play every row ``n`` times, at most ``concurrency`` at once; ``on_episode`` is called
    as each ends (for a progress bar). Each episode's spans go to ``trace`` as it ends, or
    without one to the report's ``traces`` (module docstring). A
    :class:`~corral.rollouts.player.PlayerError` (a row that cannot be played at all)
    propagates and cancels the rest."""
    if n < 1 or concurrency < 1:
        raise ValueError("n and concurrency must be at least 1")
    room = asyncio.Semaphore(concurrency)
    groups = groups or {}
    kept = TraceBuffer() if trace is None else None
    sink = trace if trace is not None else kept

    async def one(row: Row, attempt: int) -> EpisodeRecord:
        async with room:
            rollout = await player.play(
                row, group_index=row.metadata.index, index=attempt, trace=sink
            )
        record = EpisodeRecord.of(rollout, attempt, groups.get(row.metadata.task_id))
        if on_episode is not None:
            on_episode(record)
        return record

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(row, k)) for row in rows for k in range(n)]
    records = [t.result() for t in tasks]
    by_group: dict[str, list[float | None]] = defaultdict(list)
    for r in records:
        if r.group is not None:
            by_group[r.group].append(r.reward)
    return EvalReport(
        overall=Stats.of([r.reward for r in records]),
        group_by=group_by,
        groups={g: Stats.of(v) for g, v in sorted(by_group.items(), key=_group_order)},
        episodes=records,
        traces=kept.chunks if kept is not None else [],
    )


def _group_order(item: tuple[str, Any]) -> tuple[int, float | str]:
    try:
        return (0, float(item[0]))  # numeric groups (battery sizes) in numeric order
    except ValueError:
        return (1, item[0])


def report_table(report: EvalReport, title: str) -> Table:
    """The report as a table to print: one row per group, then all episodes."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("group", "episodes", "mean ± se", "graded 0", "failed"):
        table.add_column(col)
    named = [(f"{report.group_by} = {g}", s) for g, s in report.groups.items()]
    for name, stats in [*named, ("all", report.overall)]:
        table.add_row(
            name,
            str(stats.episodes),
            "-" if stats.mean is None else f"{stats.mean:.3f} ± {stats.se or 0.0:.3f}",
            "-" if stats.zero_share is None else f"{stats.zero_share:.0%}",
            str(stats.failed),
        )
    return table


def report_play(summary: Stats, failures: Sequence[tuple[str, str | None]], out: Path) -> int:
    """Print each failure's first line and the mean reward; ``corral play``'s exit code (1:
    no episode was scored)."""
    for task_id, reason in failures:
        first_line = (reason or "").splitlines()[0] if reason else ""
        print(f"failed {task_id}: {first_line}", file=sys.stderr)
    if summary.mean is None:
        print(f"no episode scored; {summary.failed} failed (see {out / 'episodes.jsonl'})")
        return 1
    spread = f" ± {summary.se:.4f}" if summary.se is not None else ""
    print(
        f"mean reward {summary.mean:.4f}{spread} (standard error) over {summary.graded} scored "
        f"episodes; {summary.failed} failed, not counted (written to {out})"
    )
    return 0


def write_eval(report: EvalReport, out: Path) -> None:
    """``episodes.jsonl`` (one line per episode), ``summary.json`` (the rest), the report's
    kept ``traces.jsonl`` (when it kept one: else a sink wrote it as the eval went) and, for a
    harness's episodes, ``transcripts/<n>.jsonl`` in ``out``."""
    from corral.rollouts.harness_play import write_transcript

    out.mkdir(parents=True, exist_ok=True)
    with (out / "episodes.jsonl").open("w") as f:
        for number, record in enumerate(report.episodes):
            f.write(record.model_dump_json() + "\n")
            if record.transcript is not None:
                write_transcript(out / "transcripts", number, record.transcript)
    summary = report.model_dump(exclude={"episodes"})
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if report.traces:
        TraceWriter(out).write_lines(report.traces)


async def eval_rows(
    rows: list[Row],
    gateway_url: str,
    *,
    admin_token: str | None = None,
    env_token: str | None = None,
    n: int = 1,
    concurrency: int = 8,
    sampling: dict[str, Any] | None = None,
    on_episode: Callable[[EpisodeRecord], None] | None = None,
    harness: HarnessOptions | None = None,
    trace: TraceSink | None = None,
) -> EvalReport:
    """:func:`run_eval` against the gateway at ``gateway_url``, with the bundle's grouping.
    ``env_token``: the env servers' token, for their task API (episodes look it up through the
    rows' token variable). ``harness``: play with a
    :class:`~corral.rollouts.harness_play.HarnessPlayer` (an agent in each episode's sandbox)
    instead of the episode player. ``trace``: as :func:`run_eval`'s."""
    group_by, groups = await asyncio.to_thread(task_groups, rows, env_token)
    async with GatewayAdmin(gateway_url, admin_token) as admin:
        player: Player | HarnessPlayer = (
            Player(admin, sampling=sampling)
            if harness is None
            else HarnessPlayer.of(admin, harness, sampling=sampling)
        )
        async with player:
            return await run_eval(
                rows,
                player,
                n=n,
                concurrency=concurrency,
                groups=groups,
                group_by=group_by,
                on_episode=on_episode,
                trace=trace,
            )
