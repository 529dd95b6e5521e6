"""Run, eval and play folders for the viewer's tests and screenshots, written by corral's own
writers (so their formats cannot drift from what the viewer reads):

- samples come from a real gateway :class:`~corral.gateway.sessions.Session` on a
  character-level stand-in for a tokenizer (one token per character, its code point), so a
  fork is the gateway's own merge decision and drift explanation;
- episodes are :class:`~corral.rollouts.evals.EpisodeRecord` and
  :class:`~corral.rollouts.harness_play.HarnessRollout` written by ``write_eval`` and
  ``write_play_outputs``; metrics by :class:`~corral.trainer.metrics.MetricsWriter`; dropped
  groups by the trainer's own ``_log_dropped``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from corral.gateway.options import SessionOptions
from corral.gateway.recording import TurnRecord
from corral.gateway.sessions import Session
from corral.rollouts.evals import EpisodeRecord, EvalReport, Stats, write_eval
from corral.rollouts.harness_play import HarnessRollout, write_play_outputs
from corral.rollouts.player import RolloutTiming
from corral.rollouts.rows import EnvRef, Row, RowMetadata
from corral.samples import Sample
from corral.trainer.metrics import STEP_KEYS, MetricsWriter

# Model output that must render as text: if the page ever parsed it as HTML, a flag is set.
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
FAILURE = "env: the episode's server went away (ConnectionResetError)"
GROUPS = ("1", "2", "4")


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def dec(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


def pieces(ids: Sequence[int]) -> list[str]:
    """The stand-in tokenizer's pieces (the viewer's ``pieces`` hook)."""
    return [chr(i) for i in ids]


def render(messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """A chat template: ``<role>content|`` per message, then ``<assistant>``."""
    ids: list[int] = []
    starts: list[int] = []
    for m in messages:
        starts.append(len(ids))
        ids += enc(f"<{m['role']}>{m['content']}|")
    return ids + enc("<assistant>"), starts


def _turn(messages: list[dict[str, Any]], output: str, version: str) -> TurnRecord:
    prompt, starts = render(messages)
    out = enc(output + "|")
    return TurnRecord(
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=[-((i % 8) + 1) / 8 for i in range(len(out))],
        finish_reason="stop",
        weight_version=version,
        messages=messages,
        message_starts=starts,
        response={"role": "assistant", "content": output},
    )


_ids = itertools.count()


def session_samples(
    task_id: str,
    group_index: int,
    *,
    fork: bool = False,
    output: str = "I will check.",
    reward: float | None = 1.0,
    failure: str | None = None,
) -> tuple[str, list[Sample]]:
    """A session of two turns recorded by the gateway's own session; with ``fork`` the
    second turn's history re-renders the first reply differently, so the gateway starts a
    second trajectory and explains the fork. Returns the session id and its samples."""
    session_id = f"sess-{task_id}-{next(_ids)}"
    session = Session(
        session_id,
        SessionOptions(
            metadata={"task_id": task_id, "api_key": "sk-must-not-show"}, group_index=group_index
        ),
        ttl_s=None,
        clock=time.monotonic,
        decode=dec,
    )
    first = [{"role": "system", "content": "Plan."}, {"role": "user", "content": "Go."}]
    session.record(_turn(first, output, "step-0"))
    held = output if not fork else output.upper()  # a template that rewrites history
    second = [*first, {"role": "assistant", "content": held}, {"role": "tool", "content": "ok"}]
    session.record(_turn(second, "Done.", "step-1"))
    if failure is not None:
        session.mark_failed(failure)
    elif reward is not None:
        session.set_reward(reward)
    return session_id, session.samples()


def _row(task_id: str, index: int, split: str = "eval") -> Row:
    env = EnvRef(url="http://127.0.0.1:1", token_var="ENV_TOKEN", max_turns=4,
                 tool_timeout=60.0, reset_timeout=60.0, model_timeout=60.0)  # fmt: skip
    meta = RowMetadata(split=split, index=index, task_id=task_id, tools=[], env=env)
    return Row(messages=[{"role": "user", "content": f"task {task_id}"}], metadata=meta)


def write_play_folder(out: Path) -> Path:
    """A ``corral play --harness`` folder of three episodes: ``p-0000`` forked (reward 1),
    ``p-0001`` whose model output is :data:`HOSTILE` (reward 0), ``p-0002`` failed."""
    rollouts = []
    specs: list[dict[str, Any]] = [
        {"fork": True},
        {"output": HOSTILE, "reward": 0.0},
        {"failure": FAILURE},
    ]
    for index, spec in enumerate(specs):
        task_id = f"p-{index:04d}"
        session_id, samples = session_samples(task_id, index, **spec)
        failed = "failure" in spec
        rollouts.append(
            HarnessRollout(
                row=_row(task_id, index),
                session_id=session_id,
                samples=samples,
                reward=None if failed else spec.get("reward", 1.0),
                failed=failed,
                reason=spec.get("failure"),
                scores={},
                turns=2,
                messages=[],
                timing=RolloutTiming(model_s=0.5, tools_s=0.2, total_s=1.0),
                harness="command",
            )
        )
    write_play_outputs(out, rollouts)
    return out


def eval_report(n: int, *, reward_of: Any = None, failed_every: int = 0) -> EvalReport:
    """``n`` eval episodes over :data:`GROUPS`; episode 1's reply is :data:`HOSTILE`;
    every ``failed_every``-th episode (from the 3rd) failed with :data:`FAILURE`."""
    records = []
    for i in range(n):
        failed = bool(failed_every) and i % failed_every == 2
        reward = None if failed else (reward_of(i) if reward_of else (i % 5) / 4)
        reply = HOSTILE if i == 1 else f"Schedule for day {i}."
        records.append(
            EpisodeRecord(
                task_id=f"eval-{i:04d}",
                split="eval",
                index=i,
                attempt=0,
                group=GROUPS[i % len(GROUPS)],
                reward=reward,
                failed=failed,
                reason=FAILURE if failed else None,
                scores={} if failed else {"grade": reward or 0.0},
                turns=2,
                tool_calls=1,
                messages=[
                    {"role": "system", "content": "You operate a grid battery."},
                    {"role": "user", "content": f"Day {i}: prices ..."},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": f"call-{i}",
                                "type": "function",
                                "function": {
                                    "name": "simulate_schedule",
                                    "arguments": '{"schedule": [0, 1, -1]}',
                                },
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": f"call-{i}", "content": '{"profit": 3.5}'},
                    {"role": "assistant", "content": reply},
                ],
                model_s=0.4,
                tools_s=0.1,
                total_s=0.6,
            )
        )
    groups = {g: Stats.of([r.reward for r in records if r.group == g]) for g in GROUPS}
    return EvalReport(
        overall=Stats.of([r.reward for r in records]),
        group_by="battery.capacity_mwh",
        groups=groups,
        episodes=records,
    )


def write_eval_folder(out: Path, n: int = 30, **kwargs: Any) -> Path:
    write_eval(eval_report(n, failed_every=7, **kwargs), out)
    return out


def _reward(step: int, i: int) -> float:
    return min(1.0, (i % 4) / 4 + 0.1 * step)


def write_run_folder(run: Path, *, steps: int = 2, episodes: int = 12) -> Path:
    """A run folder: metrics lines for ``steps`` steps with an eval before the first and after
    each (``evals/step-N``), one dropped group at step 1."""
    from corral.trainer.groups import DroppedGroup, Group, TrainRollout
    from corral.trainer.loop import Trainer

    with MetricsWriter(run, tensorboard=False) as out:
        for step in range(steps + 1):
            report = eval_report(episodes, reward_of=partial(_reward, step), failed_every=5)
            write_eval(report, run / "evals" / f"step-{step:06d}")
            out.write(
                {"step": step, "kind": "eval", "weight_version": f"step-{step}",
                 "eval/reward/mean": report.overall.mean, "eval/reward/se": report.overall.se,
                 "eval/zero_share": report.overall.zero_share,
                 "eval/failed": report.overall.failed, "eval/episodes": episodes,
                 "time/eval": 1.0,
                 **{f"eval/group/{g}": s.mean for g, s in report.groups.items()}}
            )  # fmt: skip
            if step == steps:
                break
            line: dict[str, Any] = dict.fromkeys(STEP_KEYS, 0.0)
            line.update({"step": step + 1, "weight_version": f"step-{step + 1}",
                         "reward/mean": 0.3 + 0.1 * step, "kl": None, "entropy": 3.8,
                         "time/generation": 1.5, "time/training": 7.5 + step,
                         "time/weight_sync": 0.01,
                         "dropped/failed_rollout": 1 - step % 2})  # fmt: skip
            out.write(line)
    _, samples = session_samples("train-0007", 7, failure=FAILURE)
    group = Group(7, (TrainRollout.from_samples(samples),))
    dropped = [DroppedGroup(group, "failed_rollout", FAILURE)]
    Trainer._log_dropped(SimpleNamespace(run_dir=run), 1, dropped)  # type: ignore[arg-type]
    return run
