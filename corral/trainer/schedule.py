"""When a training run checkpoints, evaluates and stops early: the cadence rules, one object
per concern, that the RL loop (:mod:`corral.trainer.loop`) and SFT
(:mod:`corral.trainer.sft_run`) ask at each step instead of spelling the arithmetic out.

``step`` is always the number of updates done; ``final`` marks the run's last step (the
schedule's end, or an early stop under a time limit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Checkpointing:
    """A checkpoint every ``every`` steps and after the run's last step; ``every = 0``: none
    at all (not even the last)."""

    every: int

    def due(self, step: int, final: bool) -> bool:
        """Whether step ``step`` (done) is saved."""
        return bool(self.every) and (step % self.every == 0 or final)


@dataclass
class Evaluation:
    """An evaluation before the first step, every ``every`` steps (0: no periodic ones) and
    after the last, never twice of one step. ``enabled`` says whether the run evaluates at
    all (e.g. it has eval data). ``done``: the steps evaluated already; a resumed run starts
    it from its metrics file, so the step it resumes from is not evaluated again (nor lost
    when a crash came between its checkpoint and its evaluation)."""

    enabled: bool
    every: int
    done: set[int] = field(default_factory=set)

    def due(self, step: int, final: bool = False) -> bool:
        """Whether the weights after ``step`` updates are evaluated now: at step 0, on every
        ``every``-th step, and (``final``) at the end of the run, unless done already."""
        if not self.enabled or step in self.done:
            return False
        return final or step == 0 or (bool(self.every) and step % self.every == 0)

    def mark(self, step: int) -> None:
        """Record that ``step`` has been evaluated."""
        self.done.add(step)


class TimeBudget:
    """Wall time left of ``seconds`` (None: unlimited), from when it is made."""

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def fits(self, seconds: float) -> bool:
        """Whether ``seconds`` more work ends before the deadline."""
        return self.deadline is None or time.monotonic() + seconds <= self.deadline
