"""gridsim's env: one battery, one day; simulate schedules, then submit one.

Tools (both take ``{"schedule": [24 integers]}``):

- ``simulate_schedule``: the profit, the state of charge after each hour and every violation,
  as a JSON object; the episode goes on.
- ``submit_schedule``: records the schedule and ends the episode (``done``). A schedule of the
  wrong length, with values outside {-1, 0, 1} or infeasible for the battery is still accepted
  as the submission (the verifier grades it 0, and the reply says why).

Arguments of the wrong shape (no ``schedule``, extra keys, not an array, non-integer items, more
values than the day has hours) and unknown tools are answered with ``error=True`` and the
episode goes on, as is a second submission. ``state()`` holds the submitted schedule and the
simulations, at most :data:`MAX_SIMULATIONS` of them: a simulation past that is refused with a
tool error, so the state an episode can grow to stays small whatever the model sends.
"""

from __future__ import annotations

import json
from typing import Any

from corral.envs.episode import Task, ToolOutcome

from .market import Battery, simulate

SIMULATE = "simulate_schedule"
SUBMIT = "submit_schedule"
# The simulations an episode may run (and the state keeps). max_turns is 8; a few per turn is
# plenty, and each kept one is 24 small integers, so the state stays a few KiB.
MAX_SIMULATIONS = 32


class GridEnv:
    """One gridsim episode (see the module docstring); call ``reset`` before any tool."""

    def __init__(self) -> None:
        self._task: Task | None = None
        self._prices: list[float] = []
        self._battery: Battery | None = None
        self._submitted: list[int] | None = None
        self._simulations: list[dict[str, Any]] = []
        self._tool_errors = 0

    def reset(self, task: Task) -> str:
        """Start on ``task``; returns its prompt. KeyError/ValueError for non-gridsim data."""
        self._task = task
        self._prices = [float(p) for p in task.data["prices"]]
        self._battery = Battery.from_data(task.data)
        self._submitted = None
        self._simulations = []
        self._tool_errors = 0
        return task.prompt

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Run a tool; RuntimeError only if ``reset`` was never called (a server bug)."""
        if self._battery is None:
            raise RuntimeError("call_tool before reset")
        if name not in (SIMULATE, SUBMIT):
            return self._error(f"unknown tool {name!r}; the tools are {SIMULATE} and {SUBMIT}")
        if self._submitted is not None:
            return self._error("a schedule was already submitted; the episode is over")
        schedule = _schedule_argument(arguments, len(self._prices))
        if isinstance(schedule, str):
            return self._error(f"{name}: {schedule}")
        if name == SIMULATE and len(self._simulations) >= MAX_SIMULATIONS:
            return self._error(
                f"{SIMULATE}: the limit of {MAX_SIMULATIONS} simulations per episode is "
                f"reached; submit a schedule with {SUBMIT}"
            )
        sim = simulate(self._prices, schedule, self._battery)
        if name == SIMULATE:
            profit = round(sim.profit, 2) if sim.valid else None
            self._simulations.append({"schedule": schedule, "valid": sim.valid, "profit": profit})
            report: dict[str, Any] = {
                "valid": sim.valid,
                "profit_eur": profit,
                "soc_mwh_after_hour": sim.soc_after_hour,
                "violations": sim.violations,
            }
            if not sim.valid:
                report["note"] = "an invalid schedule scores 0 if submitted"
            return ToolOutcome(json.dumps(report))
        self._submitted = schedule
        if sim.valid:
            charging, selling = schedule.count(1), schedule.count(-1)
            return ToolOutcome(
                f"Schedule submitted ({charging} h charging, {selling} h selling). "
                "The episode is over.",
                done=True,
            )
        problems = "; ".join(sim.violations)
        return ToolOutcome(
            f"Schedule submitted, but it is invalid ({problems}), so it scores 0. "
            "The episode is over.",
            done=True,
        )

    def state(self) -> dict[str, Any]:
        """JSON data: the task id, the submitted schedule (or None), simulations, error count."""
        return {
            "task_id": self._task.id if self._task else None,
            "submitted": self._submitted,
            "simulations": list(self._simulations),
            "tool_errors": self._tool_errors,
        }

    def _error(self, message: str) -> ToolOutcome:
        self._tool_errors += 1
        return ToolOutcome(f"error: {message}", error=True)


def _schedule_argument(arguments: Any, hours: int) -> list[int] | str:
    """The ``schedule`` argument as a list of ints, or why it is not one (a message). A list
    longer than the day's ``hours`` is refused here, before anything keeps it; a shorter one
    is a schedule (an invalid one, which ``simulate`` reports and the verifier grades 0)."""
    if not isinstance(arguments, dict):
        return 'arguments must be a JSON object: {"schedule": [24 integers]}'
    extra = sorted(set(arguments) - {"schedule"})
    if extra:
        return f'unknown argument(s) {extra}; the only argument is "schedule"'
    if "schedule" not in arguments:
        return 'missing argument "schedule" (an array of 24 integers: 1, 0 or -1)'
    schedule = arguments["schedule"]
    if not isinstance(schedule, list):
        return f'"schedule" must be an array of integers, not {_json_kind(schedule)}'
    if len(schedule) > hours:
        return f'"schedule" has {len(schedule)} values; a day has {hours} hours, one value each'
    bad = [i for i, v in enumerate(schedule) if type(v) is not int]
    if bad:
        return f'"schedule" must hold integers only; item(s) {bad[:5]} are not'
    return schedule


def _json_kind(value: Any) -> str:
    """How the model wrote ``value``, in JSON's words (it never sees Python's type names)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an object"
