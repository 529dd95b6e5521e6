"""gridsim's policies of the solver shape, ``(task) -> [{"name", "arguments"}, ...]``.

``optimal`` (the bundle's ``[solver]``) submits the day's exact optimum (``market.optimum``);
``greedy`` (a ``[[baselines]]`` entry) submits the greedy rule's schedule (``greedy.py``). Both
read only what the prompt states too: the task's prices and battery.
"""

from __future__ import annotations

from typing import Any

from corral.envs.episode import Task

from .greedy import greedy_schedule
from .market import Battery, optimum

SUBMIT = "submit_schedule"


def optimal(task: Task) -> list[dict[str, Any]]:
    """One call: submit the dynamic-programming optimum of the task's day."""
    _, schedule = optimum(task.data["prices"], Battery.from_data(task.data))
    return [{"name": SUBMIT, "arguments": {"schedule": schedule}}]


def greedy(task: Task) -> list[dict[str, Any]]:
    """One call: submit the greedy rule's schedule (one cycle a day at most)."""
    schedule = greedy_schedule(task.data["prices"], Battery.from_data(task.data))
    return [{"name": SUBMIT, "arguments": {"schedule": schedule}}]
