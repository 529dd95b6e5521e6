"""Rollouts and groups for training, the group filter, and filling a step's batch.

The trainer works on two levels above corral's :class:`~corral.samples.Sample`:

- a :class:`TrainRollout` is one episode: every sample sharing a ``rollout_id`` (a multi-turn
  episode whose context was rewritten can produce several), with the episode's one reward;
- a :class:`Group` is the rollouts played from one row (one prompt), sharing a ``group_index``.
  GRPO's baseline is taken over a group's rollouts.

Both are built by *keys*, never by reshaping a flat list by a fixed group size: a group whose
rollouts produced different numbers of samples, or a group that lost a rollout, stays intact
(reshaping is what mixes groups up in slime's default normalisation).

A rollout is *flagged* when it is no evidence of how the policy plays, and its whole group is
then dropped (the baseline of the remaining rollouts would be biased by which ones failed):

- ``failed_rollout``: a sample with status ``failed`` or ``metadata["failure"]`` (the player
  and the gateway set both when the env, the model call or the verifier failed), or a rollout
  with no reward at all (the player's contract is "reward is None exactly when failed");
- ``aborted_rollout``: a sample with status ``aborted`` or ``remove_sample`` set and no failure
  recorded (an episode cut short). The strings are those of the slime adapter's filter
  (``corral.adapters.slime``), so both trainers report the same reasons.

Optionally a group whose rewards are all equal is dropped (``all_equal``): its GRPO advantages
are all zero, so it only costs compute (and dilutes the per-rollout mean).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from corral.samples import Sample

if TYPE_CHECKING:
    from corral.rollouts.player import Rollout

DROP_FAILED = "failed_rollout"
DROP_ABORTED = "aborted_rollout"
DROP_ALL_EQUAL = "all_equal"


@dataclass(frozen=True)
class TrainRollout:
    """One episode's samples with its reward. ``flag`` is ``None`` for a usable rollout, else
    :data:`DROP_FAILED` or :data:`DROP_ABORTED`, with ``detail`` saying why. ``reward`` is a
    float for every unflagged rollout (a flagged one may have none)."""

    rollout_id: str
    group_index: int
    samples: tuple[Sample, ...]
    reward: float | None
    flag: str | None = None
    detail: str | None = None

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"rollout {self.rollout_id!r} has no samples")
        if self.flag is None and self.reward is None:
            raise ValueError(f"rollout {self.rollout_id!r} is not flagged but has no reward")
        if self.flag not in (None, DROP_FAILED, DROP_ABORTED):
            raise ValueError(f"unknown rollout flag {self.flag!r}")

    @classmethod
    def from_samples(cls, samples: Sequence[Sample]) -> TrainRollout:
        """The rollout of ``samples``, which must all share one ``rollout_id`` and one
        ``group_index`` (an int: GRPO needs groups). Flags it from the samples' status,
        ``metadata["failure"]`` and ``remove_sample`` (see the module docstring).

        ValueError: no samples, mixed rollout ids or group indices, a missing group index, or an
        unflagged rollout whose samples carry different rewards (inconsistent data, not a
        failed episode)."""
        if not samples:
            raise ValueError("a rollout needs at least one sample")
        rollout_id = samples[0].rollout_id
        if any(s.rollout_id != rollout_id for s in samples):
            raise ValueError(f"samples of several rollouts given as one ({rollout_id!r}, ...)")
        group_index = _group_index_of(rollout_id, samples)
        flag, detail = _flag(samples)
        rewards = {s.reward for s in samples}
        if flag is None and rewards == {None}:
            flag, detail = DROP_FAILED, "no reward"
        if flag is not None:
            # A flagged rollout's reward is informational only (the group is dropped).
            known = [s.reward for s in samples if s.reward is not None]
            reward = known[0] if known else None
        else:
            if len(rewards) != 1:
                raise ValueError(
                    f"rollout {rollout_id!r}: its samples carry different rewards {rewards}"
                )
            reward = samples[0].reward
        return cls(rollout_id, group_index, tuple(samples), reward, flag, detail)

    @classmethod
    def from_player(cls, rollout: Rollout) -> TrainRollout:
        """The training view of a player :class:`~corral.rollouts.player.Rollout`: as
        :meth:`from_samples`, and flagged ``failed_rollout`` with the player's reason when the
        player says it failed, whatever its samples say."""
        view = cls.from_samples(rollout.samples)
        if rollout.failed and view.flag != DROP_FAILED:
            return cls(
                view.rollout_id,
                view.group_index,
                view.samples,
                rollout.reward,
                DROP_FAILED,
                rollout.reason or "the player flagged it failed",
            )
        return view


@dataclass(frozen=True)
class Group:
    """The rollouts played from one row. ``rollouts`` keep the order they were given in."""

    group_index: int
    rollouts: tuple[TrainRollout, ...]

    def __post_init__(self) -> None:
        if not self.rollouts:
            raise ValueError(f"group {self.group_index} has no rollouts")
        for r in self.rollouts:
            if r.group_index != self.group_index:
                raise ValueError(
                    f"rollout {r.rollout_id!r} has group_index {r.group_index}, "
                    f"not {self.group_index}"
                )
        ids = [r.rollout_id for r in self.rollouts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"group {self.group_index} holds a rollout twice: {ids}")

    @property
    def samples(self) -> list[Sample]:
        return [s for r in self.rollouts for s in r.samples]

    @property
    def rewards(self) -> list[float | None]:
        """One reward per rollout (not per sample)."""
        return [r.reward for r in self.rollouts]

    @classmethod
    def from_player(cls, rollouts: Sequence[Rollout]) -> Group:
        """The group of a row's player rollouts (their samples carry the ``group_index`` the
        loop passed to ``Player.play``)."""
        views = tuple(TrainRollout.from_player(r) for r in rollouts)
        if not views:
            raise ValueError("a group needs at least one rollout")
        return cls(views[0].group_index, views)


def _group_index_of(rollout_id: str, samples: Sequence[Sample]) -> int:
    indices = {s.group_index for s in samples}
    if len(indices) != 1:
        raise ValueError(f"rollout {rollout_id!r} spans several groups: {indices}")
    (index,) = indices
    if index is None:
        raise ValueError(
            f"rollout {rollout_id!r} has no group_index: GRPO needs the loop to pass one"
        )
    return index


def _flag(samples: Sequence[Sample]) -> tuple[str | None, str | None]:
    """``(flag, detail)`` of a rollout from its samples; a failure wins over an abort."""
    aborted: str | None = None
    for s in samples:
        failure = s.metadata.get("failure")
        if failure or s.status == "failed":
            return DROP_FAILED, str(failure or "a sample has status failed")
        if aborted is None and (s.status == "aborted" or s.remove_sample):
            aborted = "a sample has status aborted" if s.status == "aborted" else "remove_sample"
    if aborted is not None:
        return DROP_ABORTED, aborted
    return None, None


def group_samples(samples: Iterable[Sample]) -> list[Group]:
    """Samples (in any order, from any number of groups) into groups: samples into rollouts by
    ``rollout_id``, rollouts into groups by ``group_index``. Groups come in the order of their
    first sample, rollouts in a group likewise, samples in a rollout in the order given.
    ValueError as :meth:`TrainRollout.from_samples` (e.g. a rollout spanning two groups)."""
    by_rollout: dict[str, list[Sample]] = {}
    for s in samples:
        by_rollout.setdefault(s.rollout_id, []).append(s)
    by_group: dict[int, list[TrainRollout]] = {}
    for rollout_samples in by_rollout.values():
        rollout = TrainRollout.from_samples(rollout_samples)
        by_group.setdefault(rollout.group_index, []).append(rollout)
    return [Group(index, tuple(rollouts)) for index, rollouts in by_group.items()]


# --------------------------------------------------------------------------- filtering


@dataclass(frozen=True)
class DroppedGroup:
    """A group left out of the batch: ``reason`` is one of ``failed_rollout``,
    ``aborted_rollout``, ``all_equal``; ``detail`` names the flagged rollouts and why."""

    group: Group
    reason: str
    detail: str


class FilterResult(NamedTuple):
    """What :func:`filter_groups` kept and dropped (unpacks as ``kept, dropped``)."""

    kept: list[Group]
    dropped: list[DroppedGroup]

    @property
    def counts(self) -> dict[str, int]:
        return drop_counts(self.dropped)


def drop_counts(dropped: Iterable[DroppedGroup]) -> dict[str, int]:
    """Dropped groups per reason (only reasons that occurred), sorted by reason."""
    return dict(sorted(Counter(d.reason for d in dropped).items()))


def group_verdict(group: Group, *, drop_all_equal: bool = False) -> DroppedGroup | None:
    """Why ``group`` is dropped, or ``None`` to keep it. ``failed_rollout`` wins over
    ``aborted_rollout``, which wins over ``all_equal``."""
    flagged = [r for r in group.rollouts if r.flag is not None]
    if flagged:
        reason = DROP_FAILED if any(r.flag == DROP_FAILED for r in flagged) else DROP_ABORTED
        detail = "; ".join(f"{r.rollout_id}: {r.flag} ({r.detail})" for r in flagged)
        return DroppedGroup(group, reason, detail)
    if drop_all_equal and len(set(group.rewards)) == 1:
        # Exact equality: the advantages of such a group are exactly zero.
        return DroppedGroup(group, DROP_ALL_EQUAL, f"every reward is {group.rewards[0]}")
    return None


def filter_groups(groups: Iterable[Group], *, drop_all_equal: bool = False) -> FilterResult:
    """Split ``groups`` into kept and dropped (with reasons); order is preserved in both. A
    group with any flagged rollout is dropped whole; with ``drop_all_equal`` a group whose
    rollouts' rewards are all exactly equal is dropped too (a one-rollout group included)."""
    kept: list[Group] = []
    dropped: list[DroppedGroup] = []
    for group in groups:
        verdict = group_verdict(group, drop_all_equal=drop_all_equal)
        if verdict is None:
            kept.append(group)
        else:
            dropped.append(verdict)
    return FilterResult(kept, dropped)


# --------------------------------------------------------------------------- filling a batch

# ``draw(n)``: up to about ``n`` more groups (the number still missing; it may return more or
# fewer). The training loop's draw plays ``n`` rows with the player, concurrently, and builds a
# Group per row (``Group.from_player``). An empty answer means the data ran out. A plain
# function works as well as a coroutine function.
Draw = Callable[[int], Awaitable[Sequence[Group]] | Sequence[Group]]


class BatchUnfillable(RuntimeError):
    """The draws could not fill the batch: ``max_draws`` reached or the data ran out. The
    message says how many groups were drawn, kept and dropped (per reason)."""

    def __init__(
        self,
        message: str,
        *,
        drawn: int,
        kept: int,
        dropped: dict[str, int],
        dropped_groups: Sequence[DroppedGroup] = (),
    ) -> None:
        super().__init__(message)
        self.drawn = drawn
        self.kept = kept
        self.dropped = dropped
        self.dropped_groups = list(dropped_groups)  # with their reasons and details


@dataclass(frozen=True)
class FilledBatch:
    """A full step: ``groups`` (exactly ``groups_per_step``, in the order drawn), ``surplus``
    (kept groups drawn beyond that: the caller may carry them to the next step or discard them),
    ``dropped`` (with reasons), ``draws`` (calls to ``draw``) and ``drawn`` (groups drawn)."""

    groups: list[Group]
    surplus: list[Group]
    dropped: list[DroppedGroup]
    draws: int
    drawn: int

    @property
    def drop_counts(self) -> dict[str, int]:
        return drop_counts(self.dropped)


async def fill_batch(
    draw: Draw,
    groups_per_step: int,
    *,
    max_draws: int,
    drop_all_equal: bool = False,
) -> FilledBatch:
    """Call ``draw(missing)`` until ``groups_per_step`` groups pass :func:`filter_groups`,
    at most ``max_draws`` times. ``missing`` is the number of kept groups still needed.

    :class:`BatchUnfillable` when ``max_draws`` calls did not fill it, or a draw returned no
    group (the data ran out); its message counts draws, groups drawn, kept, dropped per reason.
    ValueError for ``groups_per_step < 1`` or ``max_draws < 1``."""
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step must be at least 1, not {groups_per_step}")
    if max_draws < 1:
        raise ValueError(f"max_draws must be at least 1, not {max_draws}")
    kept: list[Group] = []
    dropped: list[DroppedGroup] = []
    drawn = draws = 0
    while len(kept) < groups_per_step:
        if draws == max_draws:
            why = f"max_draws ({max_draws}) reached"
            raise _unfillable(why, groups_per_step, draws, drawn, kept, dropped)
        answer = draw(groups_per_step - len(kept))
        groups = list(await answer if inspect.isawaitable(answer) else answer)
        draws += 1
        if not groups:
            raise _unfillable("the data ran out", groups_per_step, draws, drawn, kept, dropped)
        drawn += len(groups)
        result = filter_groups(groups, drop_all_equal=drop_all_equal)
        kept.extend(result.kept)
        dropped.extend(result.dropped)
    return FilledBatch(kept[:groups_per_step], kept[groups_per_step:], dropped, draws, drawn)


def _unfillable(
    why: str,
    wanted: int,
    draws: int,
    drawn: int,
    kept: list[Group],
    dropped: list[DroppedGroup],
) -> BatchUnfillable:
    counts = drop_counts(dropped)
    reasons = ", ".join(f"{reason}: {n}" for reason, n in counts.items()) or "none"
    return BatchUnfillable(
        f"could not fill a batch of {wanted} groups ({why}): {draws} draws drew {drawn} groups, "
        f"kept {len(kept)}, dropped {len(dropped)} ({reasons})",
        drawn=drawn,
        kept=len(kept),
        dropped=counts,
        dropped_groups=dropped,
    )
