"""Stage 1: the warm-start data, chat fine-tuning JSONL of the greedy rule solving days.

One line per day (:mod:`corral.trainer.sft`'s shape)::

    {"messages": [system, user, {"role": "assistant", "content": null,
                  "tool_calls": [{"id": "call_0", "type": "function", "function":
                  {"name": "submit_schedule", "arguments": "{\\"schedule\\": [...]}"}}]}],
     "tools": [simulate_schedule, submit_schedule, end_turn]}

``messages[:2]`` are exactly a row's messages and ``tools`` exactly a row's tools (checked
against the rows corral's row writer wrote from the served bundle), so the SFT prompt tokens are
the RL prompt tokens. :func:`write_transcripts` checks every line as it writes it: its
submission, read back from the JSON, is played through the bundle's env and verifier and must
be valid and grade as the greedy rule does.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from corral.envs.episode import Task

from .build import conversation


def transcript(task: Task, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSONL object of ``task`` (module docstring)."""
    return {"messages": conversation(task), "tools": tools}


def write_transcripts(
    path: Path, tasks: Sequence[Task], tools: list[dict[str, Any]]
) -> dict[str, Any]:
    """Write one line per task to ``path`` (atomically: a temporary file renamed into place)
    and return ``{"conversations", "mean_grade", "by_size"}`` (the greedy rule's mean grade per
    battery size). ValueError when a submission is refused, invalid or grades otherwise than
    the greedy rule's schedule does."""
    from bundles.gridsim.market import Battery, scores

    from .days import greedy, play_submission

    grades: dict[int, list[float]] = {}
    scratch = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    with scratch.open("w") as f:
        for task in tasks:
            line = json.dumps(transcript(task, tools), ensure_ascii=False)
            written = json.loads(line)
            call = written["messages"][-1]["tool_calls"][0]["function"]
            reward, got = play_submission(task, json.loads(call["arguments"]))
            prices, battery = task.data["prices"], Battery.from_data(task.data)
            rule = scores(prices, greedy(task), battery)
            if got["valid"] != 1.0 or got != rule or reward != rule["grade"]:
                raise ValueError(f"{task.id}: the transcript grades {got}, the greedy rule {rule}")
            grades.setdefault(battery.capacity_mwh, []).append(reward)
            f.write(line + "\n")
    scratch.rename(path)
    every = [g for size in grades.values() for g in size]
    return {
        "conversations": len(every),
        "mean_grade": statistics.fmean(every) if every else None,
        "by_size": {str(k): statistics.fmean(v) for k, v in sorted(grades.items())},
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
