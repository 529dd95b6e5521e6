"""Rollouts and groups for training: grouping by key (uneven groups), the group filter and its
reasons, and filling a step's batch with more draws (bounded, with a clear error)."""

from __future__ import annotations

import pytest

from corral.rollouts.player import Rollout, RolloutTiming
from corral.samples import Sample
from corral.trainer.groups import (
    DROP_ABORTED,
    DROP_ALL_EQUAL,
    DROP_FAILED,
    BatchUnfillable,
    Group,
    TrainRollout,
    fill_batch,
    filter_groups,
    group_samples,
)
from tests.factories import make_group, make_row, make_sample

# --------------------------------------------------------------------------- grouping


def test_group_samples_by_keys_with_uneven_groups_and_split_rollouts() -> None:
    # 8 samples, interleaved: group 0 has 3 rollouts (a split into 2 samples), group 1 has 2
    # (e split into 3). Reshaping 8 samples into groups of 4 would mix the two groups.
    samples = [
        make_sample("a", 0, 1.0),
        make_sample("d", 1, 2.0),
        make_sample("b", 0, 0.0),
        make_sample("e", 1, 0.0),
        make_sample("a", 0, 1.0),
        make_sample("e", 1, 0.0),
        make_sample("c", 0, 0.5),
        make_sample("e", 1, 0.0),
    ]
    groups = group_samples(samples)
    assert [g.group_index for g in groups] == [0, 1]
    assert [r.rollout_id for r in groups[0].rollouts] == ["a", "b", "c"]
    assert [r.rollout_id for r in groups[1].rollouts] == ["d", "e"]
    assert [len(r.samples) for r in groups[0].rollouts] == [2, 1, 1]
    assert [len(r.samples) for r in groups[1].rollouts] == [1, 3]
    # One reward per rollout, not per sample.
    assert groups[0].rewards == [1.0, 0.0, 0.5]
    assert groups[1].rewards == [2.0, 0.0]
    assert len(groups[1].samples) == 4
    assert all(r.flag is None for g in groups for r in g.rollouts)


def test_grouping_rejects_inconsistent_data() -> None:
    with pytest.raises(ValueError, match="spans several groups"):
        group_samples([make_sample("a", 0), make_sample("a", 1)])
    with pytest.raises(ValueError, match="no group_index"):
        group_samples([make_sample("a", None)])
    with pytest.raises(ValueError, match="different rewards"):
        group_samples([make_sample("a", 0, 1.0), make_sample("a", 0, 0.0)])
    with pytest.raises(ValueError, match="several rollouts"):
        TrainRollout.from_samples([make_sample("a", 0), make_sample("b", 0)])
    with pytest.raises(ValueError, match="at least one sample"):
        TrainRollout.from_samples([])
    rollout = TrainRollout.from_samples([make_sample("a", 0)])
    with pytest.raises(ValueError, match="twice"):
        Group(0, (rollout, rollout))
    with pytest.raises(ValueError, match="group_index 0, not 1"):
        Group(1, (rollout,))


@pytest.mark.parametrize(
    ("samples", "flag", "detail"),
    [
        ([make_sample("a", 0, status="failed")], DROP_FAILED, "a sample has status failed"),
        ([make_sample("a", 0, failure="env: gone")], DROP_FAILED, "env: gone"),
        ([make_sample("a", 0, None)], DROP_FAILED, "no reward"),
        ([make_sample("a", 0, status="aborted")], DROP_ABORTED, "a sample has status aborted"),
        ([make_sample("a", 0, remove=True)], DROP_ABORTED, "remove_sample"),
        # A failure anywhere in the rollout wins over an abort in another of its samples.
        (
            [make_sample("a", 0, status="aborted"), make_sample("a", 0, failure="model: timeout")],
            DROP_FAILED,
            "model: timeout",
        ),
        # The player's sample for a session that recorded no turn: aborted, removed, failure.
        (
            [make_sample("a", 0, None, status="aborted", remove=True, failure="no turn")],
            DROP_FAILED,
            "no turn",
        ),
        ([make_sample("a", 0, status="truncated")], None, None),
    ],
)
def test_rollout_flags(samples: list[Sample], flag: str | None, detail: str | None) -> None:
    rollout = TrainRollout.from_samples(samples)
    assert (rollout.flag, rollout.detail) == (flag, detail)


def _played(samples: list[Sample], *, failed: bool, reason: str | None) -> Rollout:
    return Rollout(
        row=make_row(split="train"),
        session_id=samples[0].rollout_id,
        samples=samples,
        reward=None if failed else samples[0].reward,
        failed=failed,
        reason=reason,
        scores={},
        turns=1,
        messages=[],
        timing=RolloutTiming(0.0, 0.0, 0.0),
    )


def test_group_from_player_rollouts() -> None:
    ok = _played([make_sample("a", 3, 1.0), make_sample("a", 3, 1.0)], failed=False, reason=None)
    # The player says failed even though the samples carry nothing: the player wins.
    bad = _played([make_sample("b", 3, 0.0)], failed=True, reason="env: the episode did not start")
    g = Group.from_player([ok, bad])
    assert g.group_index == 3
    assert [r.flag for r in g.rollouts] == [None, DROP_FAILED]
    assert g.rollouts[1].detail == "env: the episode did not start"
    assert len(g.rollouts[0].samples) == 2


# --------------------------------------------------------------------------- filtering


def test_filter_groups_reasons_and_counts() -> None:
    groups = [
        make_group(0, 1.0, 0.0),
        make_group(1, 1.0, 0.0, fail_first=True),
        Group(
            2,
            (
                TrainRollout.from_samples([make_sample("x", 2, 1.0)]),
                TrainRollout.from_samples([make_sample("y", 2, 0.0, status="aborted")]),
            ),
        ),
        make_group(3, 0.5, 0.5, 0.5),
        # Failed and all equal: the failure is the reason.
        make_group(4, 1.0, 1.0, fail_first=True),
        make_group(5, 0.0, 1.0, 0.0),
    ]
    kept, dropped = filter_groups(groups)
    assert [g.group_index for g in kept] == [0, 3, 5]
    assert [(d.group.group_index, d.reason) for d in dropped] == [
        (1, DROP_FAILED),
        (2, DROP_ABORTED),
        (4, DROP_FAILED),
    ]
    assert "g1r0: failed_rollout (env: it died)" in dropped[0].detail
    assert "y: aborted_rollout" in dropped[1].detail

    result = filter_groups(groups, drop_all_equal=True)
    assert [g.group_index for g in result.kept] == [0, 5]
    assert result.counts == {DROP_ABORTED: 1, DROP_ALL_EQUAL: 1, DROP_FAILED: 2}
    assert [d.reason for d in result.dropped if d.group.group_index == 3] == [DROP_ALL_EQUAL]


def test_filter_all_equal_is_exact_and_counts_single_rollout_groups() -> None:
    kept, dropped = filter_groups(
        [make_group(0, 0.5, 0.5 + 1e-9), make_group(1, 0.7)], drop_all_equal=True
    )
    assert [g.group_index for g in kept] == [0]
    assert [(d.group.group_index, d.reason) for d in dropped] == [(1, DROP_ALL_EQUAL)]


# --------------------------------------------------------------------------- fill_batch


class Draws:
    """Hands out prepared answers in turn and records what each call asked for."""

    def __init__(self, answers: list[list[Group]]) -> None:
        self.answers = answers
        self.asked: list[int] = []

    async def __call__(self, n: int) -> list[Group]:
        self.asked.append(n)
        return self.answers[len(self.asked) - 1]


async def test_fill_batch_draws_until_full() -> None:
    draws = Draws(
        [
            [
                make_group(0, 1.0, 0.0),
                make_group(1, 1.0, 0.0, fail_first=True),
                make_group(2, 0.0, 1.0),
            ],
            [make_group(3, 1.0, 1.0), make_group(4, 0.0, 0.5), make_group(5, 0.2, 0.1)],
        ]
    )
    batch = await fill_batch(draws, 3, max_draws=5, drop_all_equal=True)
    # The second call asks only for the one group still missing.
    assert draws.asked == [3, 1]
    assert [g.group_index for g in batch.groups] == [0, 2, 4]
    assert [g.group_index for g in batch.surplus] == [5]
    assert (batch.draws, batch.drawn) == (2, 6)
    assert batch.drop_counts == {DROP_ALL_EQUAL: 1, DROP_FAILED: 1}


async def test_fill_batch_takes_a_plain_function() -> None:
    made: list[int] = []

    def draw(n: int) -> list[Group]:
        made.append(n)
        return [make_group(len(made) * 10 + i, 1.0, 0.0) for i in range(n)]

    batch = await fill_batch(draw, 2, max_draws=1)
    assert made == [2]
    assert [g.group_index for g in batch.groups] == [10, 11]
    assert batch.surplus == [] and batch.dropped == []


async def test_fill_batch_is_bounded_and_says_why() -> None:
    calls = 0

    async def draw(n: int) -> list[Group]:
        nonlocal calls
        calls += 1
        return [
            make_group(calls * 10, 1.0, 0.0, fail_first=True),
            make_group(calls * 10 + 1, 1.0, 1.0),
        ]

    with pytest.raises(BatchUnfillable) as info:
        await fill_batch(draw, 4, max_draws=3, drop_all_equal=True)
    assert calls == 3
    assert str(info.value) == (
        "could not fill a batch of 4 groups (max_draws (3) reached): 3 draws drew 6 groups, "
        "kept 0, dropped 6 (all_equal: 3, failed_rollout: 3)"
    )
    assert (info.value.drawn, info.value.kept) == (6, 0)
    assert info.value.dropped == {DROP_ALL_EQUAL: 3, DROP_FAILED: 3}


async def test_fill_batch_stops_when_the_data_runs_out() -> None:
    draws = Draws([[make_group(0, 1.0, 0.0)], []])
    with pytest.raises(BatchUnfillable, match=r"the data ran out\): 2 draws drew 1 groups, kept 1"):
        await fill_batch(draws, 2, max_draws=10)
    assert draws.asked == [2, 1]


async def test_fill_batch_rejects_bad_bounds() -> None:
    draws = Draws([])
    with pytest.raises(ValueError, match="groups_per_step"):
        await fill_batch(draws, 0, max_draws=1)
    with pytest.raises(ValueError, match="max_draws"):
        await fill_batch(draws, 1, max_draws=0)
    assert draws.asked == []
