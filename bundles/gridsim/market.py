"""The battery, its day on the market, the exact optimum and the grade.

Battery model (kept whole-numbered so the optimum is exact):

- Power ``power_mw`` (1 MW), capacity ``capacity_mwh`` (1, 2 or 4 MWh), one action per hour:
  ``1`` charges at full power (buys ``power_mw`` MWh at that hour's price), ``-1`` discharges at
  full power (takes ``power_mw`` MWh out of storage and sells it), ``0`` idles.
- All the round-trip loss is applied on discharge: a charged MWh is stored whole, and each
  stored MWh sold delivers ``efficiency`` (0.85) MWh to the grid. So the state of charge stays a
  whole number of MWh and a charge/discharge pair earns ``efficiency * p_sell - p_buy``.
- The battery starts at ``initial_soc_mwh`` (empty) and may end the day at any level; energy
  left in it at midnight is worth nothing.
- A schedule is invalid when it has the wrong length, holds a value outside {-1, 0, 1} (or a
  non-integer), or would take the state of charge below 0 or above the capacity.

Grade (per the design): 0 for an invalid schedule or a loss-making one, 0.2 for idling all day
(profit 0), 1 for the optimum, linear in profit in between: ``0.2 + 0.8 * profit / optimum``.
On a day whose optimum is 0 (no trade pays for its losses) every valid schedule with profit 0
is optimal and grades 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ACTIONS = (-1, 0, 1)
IDLE_GRADE = 0.2
# Profits are sums of a few dozen cent-rounded prices: anything closer than this is float noise.
_TOLERANCE_EUR = 1e-6


@dataclass(frozen=True)
class Battery:
    """One battery; raises ValueError for sizes the whole-MWh model cannot represent."""

    capacity_mwh: int
    power_mw: int = 1
    efficiency: float = 0.85
    initial_soc_mwh: int = 0

    def __post_init__(self) -> None:
        if self.power_mw < 1 or self.capacity_mwh < 0 or self.capacity_mwh % self.power_mw:
            raise ValueError("capacity must be a whole multiple of a positive power")
        if not 0 < self.efficiency <= 1:
            raise ValueError("efficiency must be in (0, 1]")
        if not 0 <= self.initial_soc_mwh <= self.capacity_mwh:
            raise ValueError("initial state of charge must be within the capacity")

    def cash(self, action: int, price: float) -> float:
        """EUR earned in one hour by ``action`` at ``price`` (negative: money paid)."""
        if action > 0:
            return -self.power_mw * price
        if action < 0:
            return self.efficiency * self.power_mw * price
        return 0.0

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Battery:
        """The battery a task's ``data`` describes (its ``battery`` table)."""
        return cls(**data["battery"])


@dataclass(frozen=True)
class Simulation:
    """A schedule played out: ``profit`` is meaningful only when ``valid``.

    An infeasible hour is listed in ``violations`` and then skipped (the battery idles), so the
    later hours are still checked against a state of charge that makes sense.
    """

    valid: bool
    profit: float
    soc_after_hour: list[int] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


def simulate(prices: Sequence[float], schedule: Sequence[Any], battery: Battery) -> Simulation:
    """Play ``schedule`` against ``prices``; never raises for a bad schedule (it is reported)."""
    violations: list[str] = []
    if len(schedule) != len(prices):
        violations.append(
            f"the schedule has {len(schedule)} values; it needs exactly {len(prices)}, one per hour"
        )
    soc = battery.initial_soc_mwh
    profit = 0.0
    trajectory: list[int] = []
    for hour, (price, action) in enumerate(zip(prices, schedule, strict=False)):
        # bool is an int subclass and 1.0 == 1: neither is an integer action.
        if type(action) is not int or action not in ACTIONS:
            violations.append(f"hour {hour:02d}: {action!r} is not -1, 0 or 1")
        else:
            after = soc + action * battery.power_mw
            if after < 0:
                violations.append(f"hour {hour:02d}: cannot sell, the battery is empty")
            elif after > battery.capacity_mwh:
                violations.append(
                    f"hour {hour:02d}: cannot charge, the battery is full "
                    f"({battery.capacity_mwh} MWh)"
                )
            else:
                soc = after
                profit += battery.cash(action, price)
        trajectory.append(soc)
    return Simulation(not violations, profit, trajectory, violations)


def optimum(prices: Sequence[float], battery: Battery) -> tuple[float, list[int]]:
    """The day's best profit and a schedule reaching it, by dynamic programming.

    State: the state of charge in units of ``power_mw`` (0..capacity/power). ``best[s]`` is the
    most money the rest of the day can make from state ``s``; the day ends at any level, so it
    starts at 0 everywhere. Ties prefer idling, then charging, so optimal schedules trade only
    when it strictly pays. O(hours * states * 3).
    """
    levels = battery.capacity_mwh // battery.power_mw
    start = battery.initial_soc_mwh // battery.power_mw
    best = [0.0] * (levels + 1)
    choice: list[list[int]] = []
    for price in reversed(prices):
        nxt = best
        best = [0.0] * (levels + 1)
        picks = [0] * (levels + 1)
        for s in range(levels + 1):
            value, pick = nxt[s], 0
            for action in (1, -1):
                t = s + action
                if 0 <= t <= levels:
                    candidate = battery.cash(action, price) + nxt[t]
                    if candidate > value + _TOLERANCE_EUR:
                        value, pick = candidate, action
            best[s], picks[s] = value, pick
        choice.append(picks)
    choice.reverse()
    schedule, s = [], start
    for picks in choice:
        schedule.append(picks[s])
        s += picks[s]
    return best[start], schedule


def scores(
    prices: Sequence[float], schedule: Sequence[Any] | None, battery: Battery
) -> dict[str, float]:
    """The named scores of a submitted schedule (None: nothing was submitted).

    ``grade`` (the reward), ``valid`` (1/0), ``profit`` and ``optimum_profit`` (EUR; profit is 0
    for an invalid schedule) and ``ratio`` (profit / optimum; 1 on a zero-optimum day with a
    zero profit; 0 when invalid; negative for a loss, except on a zero-optimum day, where it is 0).
    """
    best, _ = optimum(prices, battery)
    if schedule is None:
        return _scores(0.0, 0.0, best, 0.0, 0.0)
    sim = simulate(prices, schedule, battery)
    if not sim.valid:
        return _scores(0.0, 0.0, best, 0.0, 0.0)
    profit = sim.profit
    if abs(profit) <= _TOLERANCE_EUR:
        profit = 0.0
    ratio = _ratio(profit, best)
    grade = 0.0 if profit < 0 else IDLE_GRADE + (1 - IDLE_GRADE) * ratio
    return _scores(grade, 1.0, best, profit, ratio)


def _ratio(profit: float, best: float) -> float:
    """profit / optimum, capped at 1 (float noise); on a zero-optimum day 1 for profit 0."""
    if best <= _TOLERANCE_EUR:
        # Nothing pays today: profit 0 is the optimum, and a loss has no meaningful ratio.
        return 1.0 if profit >= 0 else 0.0
    return min(profit / best, 1.0)


def _scores(
    grade: float, valid: float, best: float, profit: float, ratio: float
) -> dict[str, float]:
    return {
        "grade": grade,
        "valid": valid,
        "profit": profit,
        "optimum_profit": best,
        "ratio": ratio,
    }
