"""The gridsim bundle: exact optimum, grades, greedy feasibility, reproducible tasks, the env."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from bundles.gridsim.baselines import baseline_rows
from bundles.gridsim.generate import SPLITS, make_task, task_line, write_split
from bundles.gridsim.greedy import greedy_schedule
from bundles.gridsim.market import Battery, optimum, scores, simulate
from corral.envs.bundle import load_bundle, validate_bundle

BUNDLE = Path(__file__).resolve().parents[1] / "bundles" / "gridsim"


def random_prices(rng: random.Random, hours: int) -> list[float]:
    """Prices with the awkward cases mixed in: negatives, spikes, flat stretches."""
    prices = []
    for _ in range(hours):
        roll = rng.random()
        if roll < 0.15:
            prices.append(round(rng.uniform(-60, 0), 2))
        elif roll < 0.25:
            prices.append(round(rng.uniform(200, 900), 2))
        elif roll < 0.35 and prices:
            prices.append(prices[-1])
        else:
            prices.append(round(rng.uniform(20, 150), 2))
    return prices


def test_the_dp_optimum_equals_brute_force_on_small_days() -> None:
    rng = random.Random(7)
    for trial in range(24):
        battery = Battery(
            capacity_mwh=(1, 2, 4)[trial % 3],
            efficiency=rng.choice((0.85, 0.7, 1.0)),
            initial_soc_mwh=0 if trial % 4 else 1,
        )
        prices = random_prices(rng, 8)
        best = max(
            sim.profit
            for schedule in itertools.product((-1, 0, 1), repeat=8)
            if (sim := simulate(prices, list(schedule), battery)).valid
        )
        value, schedule = optimum(prices, battery)
        assert value == pytest.approx(best, abs=1e-9)
        sim = simulate(prices, schedule, battery)
        assert sim.valid and sim.profit == pytest.approx(value, abs=1e-9)


def test_grade_endpoints() -> None:
    battery = Battery(capacity_mwh=2)
    prices = random_prices(random.Random(3), 24)
    best, best_schedule = optimum(prices, battery)
    assert best > 0

    idle = scores(prices, [0] * 24, battery)
    assert idle == {"grade": 0.2, "valid": 1.0, "profit": 0.0, "optimum_profit": best, "ratio": 0}
    assert scores(prices, best_schedule, battery)["grade"] == pytest.approx(1.0)

    for invalid in ([0] * 23, [0] * 25, [2] + [0] * 23, [-1] + [0] * 23, [1.0] + [0] * 23):
        s = scores(prices, invalid, battery)
        assert (s["grade"], s["valid"], s["profit"]) == (0.0, 0.0, 0.0), invalid
    assert scores(prices, [1, 1, 1] + [0] * 21, battery)["valid"] == 0.0  # over capacity
    assert scores(prices, None, battery)["grade"] == 0.0  # nothing submitted

    # Buy at the day's most expensive hour, sell at its cheapest: a loss scores 0, not 0.2.
    flat = [50.0] * 24
    flat[3], flat[10] = 300.0, 10.0
    loss = scores(flat, [0, 0, 0, 1] + [0] * 6 + [-1] + [0] * 13, battery)
    assert loss["valid"] == 1.0 and loss["profit"] < 0 and loss["grade"] == 0.0


def test_grade_is_linear_between_idle_and_optimum() -> None:
    battery = Battery(capacity_mwh=1)
    prices = [10.0, 100.0, 20.0, 60.0] + [50.0] * 20
    best, _ = optimum(prices, battery)
    assert best == pytest.approx(0.85 * 100 - 10 + 0.85 * 60 - 20)
    one_cycle = scores(prices, [1, -1] + [0] * 22, battery)
    ratio = (0.85 * 100 - 10) / best
    assert one_cycle["ratio"] == pytest.approx(ratio)
    assert one_cycle["grade"] == pytest.approx(0.2 + 0.8 * ratio)


def test_a_day_with_nothing_to_gain_grades_idling_as_optimal() -> None:
    battery = Battery(capacity_mwh=4)
    falling = [float(100 - h) for h in range(24)]
    assert optimum(falling, battery) == (0.0, [0] * 24)
    assert scores(falling, [0] * 24, battery)["grade"] == 1.0
    assert scores(falling, [1, -1] + [0] * 22, battery)["grade"] == 0.0


def test_greedy_is_always_feasible_and_never_loses() -> None:
    bundle = load_bundle(BUNDLE)
    days = [(t.data["prices"], Battery.from_data(t.data)) for s in SPLITS for t in bundle.tasks(s)]
    rng = random.Random(11)
    days += [(random_prices(rng, 24), Battery(rng.choice((1, 2, 4)))) for _ in range(500)]
    for prices, battery in days:
        sim = simulate(prices, greedy_schedule(prices, battery), battery)
        assert sim.valid and sim.profit >= 0


def test_baselines_greedy_beats_idling_per_size() -> None:
    rows = baseline_rows(BUNDLE, "eval")
    assert [r.capacity_mwh for r in rows] == [1, 2, 4, None]
    assert sum(r.days for r in rows[:3]) == rows[3].days == 200
    for row in rows:
        assert row.idle[0] == pytest.approx(0.2)
        assert 0.2 < row.greedy[0] < 1.0


def file_digests(path: Path) -> list[str]:
    return [hashlib.sha256(line).hexdigest() for line in path.read_bytes().splitlines()]


def test_task_files_are_reproducible_from_the_generator(tmp_path: Path) -> None:
    shipped_eval = BUNDLE / "tasks" / "eval.jsonl"
    assert file_digests(write_split(tmp_path, "eval", 20250101)) == file_digests(shipped_eval)
    train = file_digests(BUNDLE / "tasks" / "train.jsonl")
    assert len(train) == 2000
    for index in (0, 1, 2, 777, 1999):
        line = task_line(make_task("train", index)).encode()
        assert hashlib.sha256(line).hexdigest() == train[index]
    # another seed, other days
    assert make_task("train", 5, seed=1)["data"] != make_task("train", 5)["data"]


def test_tasks_hold_realistic_days() -> None:
    tasks = load_bundle(BUNDLE).tasks("train")
    prices = [p for t in tasks for p in t.data["prices"]]
    assert all(len(t.data["prices"]) == 24 for t in tasks)
    negative_days = sum(min(t.data["prices"]) < 0 for t in tasks) / len(tasks)
    spike_days = sum(max(t.data["prices"]) > 250 for t in tasks) / len(tasks)
    assert 0.02 < negative_days < 0.25 and 0.01 < spike_days < 0.1
    assert 30 < sum(prices) / len(prices) < 120
    sizes = {t.data["battery"]["capacity_mwh"] for t in tasks}
    assert sizes == {1, 2, 4}
    assert "submit_schedule" in tasks[0].prompt and f"{prices[0]:.2f}" in tasks[0].prompt


def test_the_env_plays_an_episode_and_survives_tool_errors() -> None:
    bundle = load_bundle(BUNDLE)
    task = bundle.task("eval", 1)
    env = bundle.make_env()
    assert env.reset(task) == task.prompt

    bad_calls: list[tuple[str, dict[str, Any]]] = [
        ("charge_battery", {"schedule": [0] * 24}),
        ("simulate_schedule", {}),
        ("simulate_schedule", {"schedule": [0] * 24, "mode": "fast"}),
        ("simulate_schedule", {"schedule": "[0, 0, 0]"}),
        ("submit_schedule", {"schedule": [0.0] * 24}),
        ("submit_schedule", {"schedule": [True] * 24}),
    ]
    for name, arguments in bad_calls:
        outcome = env.call_tool(name, arguments)
        assert outcome.error and not outcome.done and outcome.content.startswith("error: ")
    assert env.state()["tool_errors"] == len(bad_calls) and env.state()["submitted"] is None

    report = json.loads(env.call_tool("simulate_schedule", {"schedule": [-1] + [0] * 22}).content)
    assert report["valid"] is False and report["profit_eur"] is None
    assert any("24" in v for v in report["violations"])
    assert any("empty" in v for v in report["violations"])

    greedy = greedy_schedule(task.data["prices"], Battery.from_data(task.data))
    report = json.loads(env.call_tool("simulate_schedule", {"schedule": greedy}).content)
    assert report["valid"] is True and report["violations"] == [] and report["profit_eur"] > 0

    outcome = env.call_tool("submit_schedule", {"schedule": greedy})
    assert outcome.done and not outcome.error
    again = env.call_tool("submit_schedule", {"schedule": [0] * 24})
    assert again.error and "already submitted" in again.content

    state = env.state()
    json.dumps(state)  # plain JSON data
    assert state["submitted"] == greedy and len(state["simulations"]) == 2
    result = bundle.grade(task, state)
    assert result["valid"] == 1.0 and 0.2 < bundle.reward(result) <= 1.0


def test_an_invalid_submission_ends_the_episode_with_grade_zero() -> None:
    bundle = load_bundle(BUNDLE)
    task = bundle.task("eval", 0)
    env = bundle.make_env()
    env.reset(task)
    outcome = env.call_tool("submit_schedule", {"schedule": [-1] * 24})
    assert outcome.done and "invalid" in outcome.content
    assert bundle.reward(bundle.grade(task, env.state())) == 0.0
    fresh = bundle.make_env()
    fresh.reset(task)
    assert bundle.grade(task, fresh.state())["grade"] == 0.0  # ended without a submission


def test_the_bundle_validates() -> None:
    assert validate_bundle(BUNDLE) == []
    manifest = load_bundle(BUNDLE).manifest
    assert manifest.reward.score == "grade" and manifest.sandbox.needs == "none"
    assert [t.name for t in manifest.tools] == ["simulate_schedule", "submit_schedule"]


def test_the_env_bounds_what_an_episode_keeps() -> None:
    """A long schedule is refused before anything keeps it, and simulations stop at a limit:
    the state stays small whatever the model sends (the server also caps it, in bytes)."""
    from bundles.gridsim.env import MAX_SIMULATIONS

    bundle = load_bundle(BUNDLE)
    task = bundle.task("eval", 2)
    env = bundle.make_env()
    env.reset(task)
    for name in ("simulate_schedule", "submit_schedule"):
        outcome = env.call_tool(name, {"schedule": [0] * 1_000_000})
        assert outcome.error and not outcome.done
        assert "has 1000000 values; a day has 24 hours" in outcome.content
    assert env.state()["simulations"] == [] and env.state()["submitted"] is None

    short = env.call_tool("simulate_schedule", {"schedule": [0] * 5})  # short: reported, kept
    assert not short.error and json.loads(short.content)["valid"] is False
    for _ in range(MAX_SIMULATIONS - 1):
        assert not env.call_tool("simulate_schedule", {"schedule": [0] * 24}).error
    refused = env.call_tool("simulate_schedule", {"schedule": [0] * 24})
    assert refused.error and f"limit of {MAX_SIMULATIONS} simulations" in refused.content
    assert "submit_schedule" in refused.content
    state = env.state()
    assert len(state["simulations"]) == MAX_SIMULATIONS
    assert len(json.dumps(state)) < 8 * 1024 < bundle.manifest.limits.max_state_bytes

    greedy = greedy_schedule(task.data["prices"], Battery.from_data(task.data))
    assert env.call_tool("submit_schedule", {"schedule": greedy}).done  # still submits
    assert bundle.grade(task, env.state())["valid"] == 1.0
