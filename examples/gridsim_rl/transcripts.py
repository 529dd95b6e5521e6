"""Stage 1: the warm-start data, chat fine-tuning JSONL of the teacher solving days.

The teacher (:mod:`.teacher`) is the greedy rule, whose schedule is submitted with one or two
hours changed at random on a share of the days (the exploration the warm start gives RL).

One line per day (:mod:`corral.trainer.sft`'s shape)::

    {"messages": [system, user, {"role": "assistant", "content": null,
                  "tool_calls": [{"id": "call_0", "type": "function", "function":
                  {"name": "submit_schedule", "arguments": "{\\"schedule\\": [...]}"}}]}],
     "tools": [simulate_schedule, submit_schedule, end_turn]}

``messages[:2]`` are exactly a row's messages and ``tools`` exactly a row's tools (checked
against the rows corral's row writer wrote from the served bundle), so the SFT prompt tokens are
the RL prompt tokens. :func:`write_transcripts` checks every line as it writes it: its
submission, read back from the JSON, is played through the bundle's env and verifier and must
be valid and grade as the teacher's schedule does (the greedy rule's, where not edited).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from corral.envs.episode import Task

from .build import conversation
from .teacher import teacher_schedule


def transcript(task: Task, tools: list[dict[str, Any]], schedule: Sequence[int]) -> dict[str, Any]:
    """The JSONL object of ``task`` submitting ``schedule`` (module docstring)."""
    return {"messages": conversation(task, schedule), "tools": tools}


def write_transcripts(
    path: Path, tasks: Sequence[Task], tools: list[dict[str, Any]], edit_share: float, seed: int
) -> dict[str, Any]:
    """Write one line per task to ``path`` (atomically: a temporary file renamed into place),
    the teacher's schedule (:func:`.teacher.teacher_schedule` with ``edit_share`` and ``seed``)
    as the reply, and return ``{"conversations", "mean_grade", "by_size", "greedy_mean_grade",
    "edited", "edited_mean_grade", "edited_better", "edited_graded_0"}``: the data's mean grade
    (per battery size), the greedy rule's on the same days, and the edited days' count, mean
    grade and how many of them beat the rule or grade 0. ValueError when a submission is
    refused, invalid or grades otherwise than the teacher's schedule does."""
    from bundles.gridsim.baselines import baseline_scores
    from bundles.gridsim.market import Battery, scores

    from .days import play_submission

    grades: dict[int, list[float]] = {}
    rule_grades: list[float] = []
    edited: list[tuple[float, float]] = []
    scratch = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    with scratch.open("w") as f:
        for task in tasks:
            teacher = teacher_schedule(task, edit_share, seed)
            line = json.dumps(transcript(task, tools, teacher.schedule), ensure_ascii=False)
            written = json.loads(line)
            call = written["messages"][-1]["tool_calls"][0]["function"]
            reward, got = play_submission(task, json.loads(call["arguments"]))
            prices, battery = task.data["prices"], Battery.from_data(task.data)
            meant = scores(prices, teacher.schedule, battery)
            if got["valid"] != 1.0 or got != meant or reward != meant["grade"]:
                raise ValueError(f"{task.id}: the transcript grades {got}, its schedule {meant}")
            rule = baseline_scores(task.data)[1]["grade"]
            if teacher.edited:
                edited.append((reward, rule))
            elif reward != rule:
                raise ValueError(f"{task.id}: an unedited transcript grades {reward}, not {rule}")
            grades.setdefault(battery.capacity_mwh, []).append(reward)
            rule_grades.append(rule)
            f.write(line + "\n")
    scratch.rename(path)
    every = [g for size in grades.values() for g in size]
    return {
        "conversations": len(every),
        "mean_grade": statistics.fmean(every) if every else None,
        "by_size": {str(k): statistics.fmean(v) for k, v in sorted(grades.items())},
        "greedy_mean_grade": statistics.fmean(rule_grades) if rule_grades else None,
        "edited": len(edited),
        "edited_mean_grade": statistics.fmean(g for g, _ in edited) if edited else None,
        "edited_better": sum(g > r for g, r in edited),
        "edited_graded_0": sum(g == 0.0 for g, _ in edited),
    }


def token_stats(path: Path, tokenizer: Any, limit: int | None = None) -> dict[str, float]:
    """Render the first ``limit`` lines of ``path`` as the gateway does
    (:func:`corral.trainer.sft.tokenize_chat`): their longest length, mean length and mean
    trained (reply) tokens."""
    from corral.trainer.sft import ChatExample, tokenize_chat

    lengths, trained = [], []
    with path.open() as f:
        for n, line in enumerate(f):
            if limit is not None and n >= limit:
                break
            obj = json.loads(line)
            sample = tokenize_chat(tokenizer, ChatExample(obj["messages"], obj["tools"]))
            lengths.append(sample.num_tokens)
            trained.append(sample.num_trained)
    return {
        "longest": max(lengths),
        "mean_tokens": statistics.fmean(lengths),
        "mean_reply_tokens": statistics.fmean(trained),
    }
