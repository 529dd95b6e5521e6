"""The order a run takes its data in: :class:`RowSampler`, items in a seeded random order,
reshuffled every epoch. The RL loop draws its rows from one, SFT its conversations; its
position is part of every checkpoint (:class:`~corral.trainer.checkpoint.TrainerState`), so a
resumed run continues the same sequence."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class RowSampler(Generic[T]):
    """Rows (or any items: SFT takes conversations) in a seeded random order, reshuffled every
    epoch. Its position (``epoch``, ``offset``) is all a resumed run needs to continue the
    same sequence."""

    def __init__(self, rows: Sequence[T], *, seed: int = 0) -> None:
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

    def take(self, n: int) -> list[T]:
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
