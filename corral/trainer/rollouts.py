"""Where a training step's groups come from: rows played with the episode player.

:class:`RowSampler` hands out rows in a seeded order, epoch after epoch. :class:`GroupDraw` is
the ``draw`` that :func:`~corral.trainer.groups.fill_batch` calls: for each of ``n`` rows it plays
``rollouts_per_row`` rollouts through the gateway (at most ``concurrency`` at once), each with
the row's own ``group_index``, and returns one :class:`~corral.trainer.groups.Group` per row.
A row that cannot be played at all (:class:`~corral.adapters.player.PlayerError`: a
configuration problem) stops the draw; failed rollouts come back flagged, and the filter drops
their groups.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Sequence
from typing import Any

from corral.adapters.player import Player, Rollout
from corral.adapters.rows import Row
from corral.trainer.groups import Group


class RowSampler:
    """Rows in a seeded random order, reshuffled every epoch. Its position (``epoch``,
    ``offset``) is all a resumed run needs to continue the same sequence."""

    def __init__(self, rows: Sequence[Row], *, seed: int = 0) -> None:
        if not rows:
            raise ValueError("no rows to train on")
        self.rows = list(rows)
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def take(self, n: int) -> list[Row]:
        """The next ``n`` rows (crossing into the next epoch when this one runs out)."""
        out = []
        for _ in range(n):
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.rows[self._order[self.offset]])
            self.offset += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._shuffled(self.epoch)


class GroupDraw:
    """``draw(n)`` for :func:`~corral.trainer.groups.fill_batch` (module docstring). Group
    indices are unique across the run (a counter), so groups never mix between draws."""

    def __init__(
        self,
        player: Player,
        rows: RowSampler,
        *,
        rollouts_per_row: int,
        concurrency: int = 8,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if rollouts_per_row < 1 or concurrency < 1:
            raise ValueError("rollouts_per_row and concurrency must be at least 1")
        self.player = player
        self.rows = rows
        self.rollouts_per_row = rollouts_per_row
        self.metadata = dict(metadata or {})
        self._room = asyncio.Semaphore(concurrency)
        self._groups = itertools.count()
        self.played: list[Rollout] = []  # every rollout of the current step, for metrics

    async def _one(self, row: Row, group_index: int, index: int) -> Rollout:
        async with self._room:
            return await self.player.play(
                row, group_index=group_index, index=index, metadata=self.metadata
            )

    async def __call__(self, n: int) -> list[Group]:
        rows = self.rows.take(n)
        indices = [next(self._groups) for _ in rows]
        async with asyncio.TaskGroup() as tg:
            tasks = [
                [tg.create_task(self._one(row, g, k)) for k in range(self.rollouts_per_row)]
                for row, g in zip(rows, indices, strict=True)
            ]
        played = [[t.result() for t in row_tasks] for row_tasks in tasks]
        self.played.extend(r for group in played for r in group)
        return [Group.from_player(group) for group in played]
