"""Where a training step's groups come from: rows played with the episode player.

:class:`GroupDraw` is the ``draw`` that :func:`~corral.trainer.groups.fill_batch` calls: for
each of ``n`` rows (taken from a :class:`~corral.trainer.sampling.RowSampler`, in its seeded
order) it plays ``rollouts_per_row`` rollouts through the gateway (at most ``concurrency`` at
once), each with the row's own ``group_index``, and returns one
:class:`~corral.trainer.groups.Group` per row.
The player may be a :class:`~corral.rollouts.harness_play.HarnessPlayer` (``[agent]``: a
black-box agent plays each rollout in its episode's sandbox); its rollouts are counted,
filtered and trained on like the episode player's.
A row that cannot be played at all (:class:`~corral.rollouts.player.PlayerError`: a
configuration problem) stops the draw; failed rollouts come back flagged, and the filter drops
their groups.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

from corral.rollouts.harness_play import HarnessPlayer
from corral.rollouts.player import Player, Rollout
from corral.rollouts.rows import Row
from corral.trainer.groups import Group
from corral.trainer.sampling import RowSampler


class GroupDraw:
    """``draw(n)`` for :func:`~corral.trainer.groups.fill_batch` (module docstring). Group
    indices are unique across the run (``next_group_index`` counts on; a resumed run restores
    it), so groups never mix between draws. With ``seed`` set, rollout ``k`` of group ``g`` is
    sampled with the seed derived from ``(seed, g, k)``: a resumed run plays the same rollouts
    as the run it continues, at any temperature (given the same weights)."""

    def __init__(
        self,
        player: Player | HarnessPlayer,
        rows: RowSampler[Row],
        *,
        rollouts_per_row: int,
        concurrency: int = 8,
        metadata: dict[str, Any] | None = None,
        seed: int | None = None,
        next_group_index: int = 0,
        on_played: Callable[[Rollout], None] | None = None,
    ) -> None:
        if rollouts_per_row < 1 or concurrency < 1:
            raise ValueError("rollouts_per_row and concurrency must be at least 1")
        self.player = player
        self.rows = rows
        self.rollouts_per_row = rollouts_per_row
        self.metadata = dict(metadata or {})
        self.seed = seed
        self.next_group_index = next_group_index
        self.on_played = on_played
        self._room = asyncio.Semaphore(concurrency)
        self.played: list[Rollout] = []  # every rollout since the last take_played()

    def take_played(self) -> list[Rollout]:
        """The rollouts played since the last call (for a step's metrics), and forget them."""
        played, self.played = self.played, []
        return played

    async def _one(self, row: Row, group_index: int, index: int) -> Rollout:
        sampling = (
            None if self.seed is None else {"seed": rollout_seed(self.seed, group_index, index)}
        )
        async with self._room:
            rollout = await self.player.play(
                row, group_index=group_index, index=index, metadata=self.metadata, sampling=sampling
            )
        if self.on_played is not None:
            self.on_played(rollout)
        return rollout

    async def __call__(self, n: int) -> list[Group]:
        rows = self.rows.take(n)
        indices = list(range(self.next_group_index, self.next_group_index + len(rows)))
        self.next_group_index += len(rows)
        async with asyncio.TaskGroup() as tg:
            tasks = [
                [tg.create_task(self._one(row, g, k)) for k in range(self.rollouts_per_row)]
                for row, g in zip(rows, indices, strict=True)
            ]
        played = [[t.result() for t in row_tasks] for row_tasks in tasks]
        self.played.extend(r for group in played for r in group)
        return [Group.from_player(group) for group in played]


def rollout_seed(seed: int, group_index: int, index: int) -> int:
    """A sampling seed for rollout ``index`` of group ``group_index``: stable across runs and
    processes (not Python's salted ``hash``), below 2**62."""
    digest = hashlib.sha256(f"{seed}/{group_index}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2
