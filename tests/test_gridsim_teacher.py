"""The gridsim example's warm-start teacher (examples/gridsim_rl/teacher.py): the random edits of
the greedy rule's schedule are feasible, change one or two hours, are uniform over every such
schedule, ignore prices, and are a deterministic function of the seed and the day."""

from __future__ import annotations

import itertools
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from gridsim_rl.days import greedy, gridsim  # noqa: E402
from gridsim_rl.teacher import random_edit, teacher_schedule  # noqa: E402

from bundles.gridsim.market import Battery, scores, simulate  # noqa: E402


def _changed(a: list[int], b: list[int]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def test_an_edit_is_feasible_changes_one_or_two_hours_and_can_gain_or_lose() -> None:
    rng = random.Random(0)
    gains = losses = 0
    for task in gridsim().tasks("eval")[:30]:
        prices, battery = task.data["prices"], Battery.from_data(task.data)
        rule = greedy(task)
        for _ in range(20):
            edit = random_edit(rule, battery, rng)
            assert simulate(prices, edit, battery).valid
            assert _changed(edit, rule) in (1, 2)
            delta = scores(prices, edit, battery)["grade"] - scores(prices, rule, battery)["grade"]
            gains += delta > 1e-9
            losses += delta < -1e-9
    # Price-blind: most edits lose, yet some beat the rule (what RL is to find).
    assert 0 < gains < losses


def test_edits_are_uniform_over_the_feasible_schedules_one_or_two_hours_away() -> None:
    """A 4-hour day with a 1 MWh battery: every feasible schedule at distance 1-2 from
    [1, 0, -1, 0] is drawn, each about equally often."""
    rule, battery = [1, 0, -1, 0], Battery(capacity_mwh=1)
    flat = [0.0] * len(rule)
    support = {
        s
        for s in itertools.product((-1, 0, 1), repeat=len(rule))
        if _changed(list(s), rule) in (1, 2) and simulate(flat, list(s), battery).valid
    }
    rng = random.Random(1)
    draws = 200 * len(support)
    counts = Counter(tuple(random_edit(rule, battery, rng)) for _ in range(draws))
    assert set(counts) == support
    # Each count is Binomial(draws, 1/len(support)): mean 200, sd ~14; 5 sd either side.
    assert all(130 < n < 270 for n in counts.values()), counts


def test_the_teacher_edits_a_share_of_days_deterministically() -> None:
    tasks = gridsim().tasks("train")[:300]
    picks = [teacher_schedule(t, 0.4, seed=7) for t in tasks]
    assert picks == [teacher_schedule(t, 0.4, seed=7) for t in tasks]
    share = sum(p.edited for p in picks) / len(picks)
    assert share == pytest.approx(0.4, abs=0.08)
    for task, pick in zip(tasks, picks, strict=True):
        assert (pick.schedule != greedy(task)) == pick.edited
    assert not any(teacher_schedule(t, 0.0, seed=7).edited for t in tasks)
    assert all(teacher_schedule(t, 1.0, seed=7).edited for t in tasks)
    other = [teacher_schedule(t, 0.4, seed=8) for t in tasks]
    assert other != picks
