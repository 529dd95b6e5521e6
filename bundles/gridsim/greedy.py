"""The greedy baseline: one charge/discharge cycle a day, no look at the day's shape.

Rule, for a battery of ``k = capacity / power`` hours:

1. charge hours: the ``k`` cheapest hours of the day (ties: the earlier hour);
2. sell hours: the ``k`` most expensive hours after the first charge hour that are not charge
   hours (ties: the earlier hour);
3. sort both lists by hour and pair them in order (first charge hour with first sell hour, ...);
   keep a pair only if the charge comes first and the sale pays for the loss
   (``efficiency * p_sell > p_buy``); the rest of the day idles.

Always feasible: each kept sale has its own earlier charge (so the battery never goes below
empty) and at most ``k`` charges happen (so it never goes above full). What it misses, and what a
trained model can learn: a second cycle on days with a morning and an evening peak, cheap hours
that fall after the peak, and partial cycles around spikes and negative prices.
"""

from __future__ import annotations

from collections.abc import Sequence

from .market import Battery


def greedy_schedule(prices: Sequence[float], battery: Battery) -> list[int]:
    """The greedy rule's schedule for ``prices`` (one action per hour, always feasible)."""
    hours = range(len(prices))
    k = battery.capacity_mwh // battery.power_mw
    charge = sorted(sorted(hours, key=lambda h: (prices[h], h))[:k])
    rest = [h for h in hours if h > charge[0] and h not in set(charge)] if charge else []
    sell = sorted(sorted(rest, key=lambda h: (-prices[h], h))[:k])
    schedule = [0] * len(prices)
    for c, s in zip(charge, sell, strict=False):
        if c < s and battery.cash(-1, prices[s]) + battery.cash(1, prices[c]) > 0:
            schedule[c], schedule[s] = 1, -1
    return schedule
