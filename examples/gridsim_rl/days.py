"""The days the example trains and evaluates on, and the rows the env server serves for them.

- :func:`synthetic_tasks`: extra gridsim days for the warm start, made by the bundle's own code
  (``generate.render_prompt``, ``prices.day_prices``, ``generate.task_rng``) on dates before the
  train split, so they are gridsim tasks in every respect but their dates and price draws.
- :func:`check_disjoint`: raises when a synthetic day shares a ``(date, battery)`` or a price list
  with an eval day.
- :func:`serve_rows`: the real rows: the bundle served by corral's env server in this process and
  written by corral's row writer (what ``corral rows`` writes), read back.
- :func:`row_messages`: the chat messages of a task exactly as the row writer builds them;
  :func:`check_rows` proves it on every served row and returns the tools the rows offer (the
  task's tools plus the server's ``end_turn``, the same for every gridsim task).
- :func:`greedy` and :func:`play_submission`: the greedy rule's schedule, and a schedule played
  through the bundle's own env and verifier (its reward and scores).
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from corral.envs.bundle import Bundle, load_bundle
from corral.envs.episode import Task
from corral.rollouts.rows import Row, RowSettings, read_rows, write_rows

from .settings import BUNDLE, DaysSettings

SYNTHETIC_SPLIT = "synthetic"


@functools.cache
def gridsim() -> Bundle:
    """The gridsim bundle, loaded once."""
    return load_bundle(BUNDLE)


def synthetic_task(index: int, seed: int, last_date: dt.date) -> Task:
    """Synthetic day ``index``: on ``last_date - index`` days, battery size cycling 1, 2, 4 MWh,
    prices from gridsim's price model seeded by ``(seed, "synthetic", index)``."""
    from bundles.gridsim.generate import day_battery, render_prompt, task_data, task_rng
    from bundles.gridsim.prices import day_prices

    date = last_date - dt.timedelta(days=index)
    battery = day_battery(index)
    prices = day_prices(task_rng(seed, SYNTHETIC_SPLIT, index), date)
    return Task(
        id=f"{SYNTHETIC_SPLIT}-{index:05d}",
        split=SYNTHETIC_SPLIT,
        index=index,
        prompt=render_prompt(date, battery, prices),
        data=task_data(date, battery, prices),
    )


def synthetic_tasks(days: DaysSettings) -> list[Task]:
    """The ``days.synthetic`` synthetic days, index 0 first."""
    return [synthetic_task(i, days.seed, days.last_date) for i in range(days.synthetic)]


def _key(task: Task) -> tuple[str, int]:
    return task.data["date"], task.data["battery"]["capacity_mwh"]


def check_disjoint(synthetic: Iterable[Task], evals: Sequence[Task]) -> None:
    """ValueError naming the first synthetic day that shares a ``(date, battery size)`` or a
    price list with one of ``evals``."""
    eval_keys = {_key(t) for t in evals}
    eval_prices = {tuple(t.data["prices"]) for t in evals}
    for task in synthetic:
        if _key(task) in eval_keys or tuple(task.data["prices"]) in eval_prices:
            raise ValueError(f"synthetic day {task.id} ({task.data['date']}) is an eval day")


def serve_rows(out: Path, max_turns: int) -> list[Row]:
    """Serve the bundle with corral's env server (in this process, no sandbox: gridsim needs
    none), write its rows into ``out`` with corral's row writer, stop the server and return
    every row (``out/all.jsonl``). The rows' env URL is dead afterwards: they are read for
    their messages and tools only."""
    from corral.envs.server import build_app
    from corral.serving import serve_in_thread

    with serve_in_thread(build_app(BUNDLE)) as url:
        write_rows(url, out, RowSettings(max_turns=max_turns))
    return read_rows(out / "all.jsonl")


def row_messages(task: Task) -> list[dict[str, str]]:
    """The messages the row writer makes for ``task`` (system prompt, then the task prompt)."""
    system = gridsim().manifest.system_prompt
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": task.prompt}]


def check_rows(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Check that every row's messages are :func:`row_messages` of its task and that every row
    offers the same tools; return those tools. ValueError naming the first row that differs."""
    if not rows:
        raise ValueError("no rows")
    tools = rows[0].metadata.tools
    for row in rows:
        meta = row.metadata
        if row.messages != row_messages(gridsim().task(meta.split, meta.index)):
            raise ValueError(f"row {meta.task_id}: its messages are not the task's as rendered")
        if row.metadata.tools != tools:
            raise ValueError(
                f"row {meta.task_id} offers other tools than {rows[0].metadata.task_id}"
            )
    return tools


def greedy(task: Task) -> list[int]:
    """The greedy rule's schedule for ``task`` (bundles/gridsim/greedy.py)."""
    from bundles.gridsim.greedy import greedy_schedule
    from bundles.gridsim.market import Battery

    return greedy_schedule(task.data["prices"], Battery.from_data(task.data))


def play_submission(task: Task, arguments: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """``submit_schedule(arguments)`` played in a fresh env of the bundle on ``task``, graded by
    the bundle's verifier: ``(reward, scores)``. ValueError when the env refuses the call or the
    episode does not end."""
    bundle = gridsim()
    env = bundle.make_env()
    env.reset(task)
    outcome = env.call_tool("submit_schedule", arguments)
    if outcome.error or not outcome.done:
        raise ValueError(f"{task.id}: submit_schedule was refused: {outcome.content}")
    scores = bundle.grade(task, env.state())
    return bundle.reward(scores), scores
