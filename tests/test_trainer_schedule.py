"""The cadence rules of a training run (corral.trainer.schedule): which steps checkpoint,
which evaluate, and when a time limit ends the run. Plain arithmetic, no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from corral.trainer import schedule
from corral.trainer.schedule import Checkpointing, Evaluation, TimeBudget


def test_checkpoints_come_every_n_steps_and_after_the_last() -> None:
    every_3 = Checkpointing(3)
    assert [s for s in range(1, 10) if every_3.due(s, final=False)] == [3, 6, 9]
    assert every_3.due(4, final=True)  # the last step (the schedule's end or a time limit)
    assert every_3.due(6, final=True)


def test_checkpoint_every_zero_saves_nothing_not_even_the_last() -> None:
    never = Checkpointing(0)
    assert not any(never.due(s, final=f) for s in range(6) for f in (False, True))


def test_evaluations_come_at_the_start_every_n_steps_and_at_the_end() -> None:
    every_2 = Evaluation(enabled=True, every=2)
    assert [s for s in range(6) if every_2.due(s)] == [0, 2, 4]
    assert every_2.due(5, final=True)


def test_no_periodic_evaluation_still_evaluates_the_start_and_the_end() -> None:
    # SFT with eval data and eval_every = 0.
    ends_only = Evaluation(enabled=True, every=0)
    assert [s for s in range(6) if ends_only.due(s)] == [0]
    assert ends_only.due(5, final=True)


def test_a_run_without_evaluation_never_evaluates() -> None:
    off = Evaluation(enabled=False, every=2)
    assert not any(off.due(s, final=f) for s in range(6) for f in (False, True))


def test_a_step_is_evaluated_once_including_one_a_resumed_run_already_has() -> None:
    evaluation = Evaluation(enabled=True, every=5, done={10})  # from the metrics file
    assert not evaluation.due(10)
    assert not evaluation.due(10, final=True)
    assert evaluation.due(15)
    evaluation.mark(15)
    assert not evaluation.due(15) and not evaluation.due(15, final=True)
    assert evaluation.due(20)


def test_the_time_budget_counts_from_when_it_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(schedule, "time", SimpleNamespace(monotonic=lambda: now[0]))
    budget = TimeBudget(60.0)
    assert budget.fits(60.0) and not budget.fits(60.5)
    now[0] = 150.0
    assert budget.fits(10.0) and not budget.fits(10.5)
    assert TimeBudget(None).fits(1e12)
