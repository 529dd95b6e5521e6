"""gridsim's verifier: grade the submitted schedule against the day's exact optimum.

Scores (see ``market.scores``): ``grade`` (the reward: 0 invalid or loss-making, 0.2 idle, 1
optimal, linear in profit in between), ``valid``, ``profit``, ``optimum_profit``, ``ratio``.
An episode that ended without a submission grades 0, like an invalid schedule. The verifier
trusts only the task's data and the schedule the state holds: it recomputes the profit itself.
Raises KeyError / ValueError only for a task whose data is not a gridsim day (a bundle bug).
"""

from __future__ import annotations

from typing import Any

from corral.envs.episode import Task

from .market import Battery, scores


def grade(task: Task, state: dict[str, Any]) -> dict[str, float]:
    """The named scores of the episode whose final env state is ``state``."""
    submitted = state.get("submitted")
    schedule = submitted if isinstance(submitted, list) else None
    return scores(task.data["prices"], schedule, Battery.from_data(task.data))
