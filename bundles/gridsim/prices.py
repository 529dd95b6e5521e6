"""Synthetic day-ahead prices: 24 hourly EUR/MWh values for one day, from a seeded RNG.

The shape imitates a European day-ahead market (no real data is used):

- a daily level: higher in winter, lower at weekends, a log-normal day-to-day factor (fuel and
  demand) and a windy-day discount;
- an hourly profile: a night trough, a morning peak (07-09), an evening peak (17-20, the day's
  highest) and a midday solar dip (10-16) whose depth follows the season and the day's sunshine;
  on sunny, windy or weekend days the dip goes below zero;
- autocorrelated hourly noise, and on a few days a scarcity spike in a peak hour.

Prices are rounded to cents and floored at -500 (the market's price floor). Only Python's
``random.Random`` is used, so a seed gives the same prices on every platform.
"""

from __future__ import annotations

import datetime as dt
import math
import random

PRICE_FLOOR = -500.0
# Multipliers of the daily level, hours 00..23, before solar, noise and spikes.
_PROFILE = (
    0.82, 0.78, 0.75, 0.74, 0.76, 0.82,
    0.95, 1.15, 1.28, 1.20, 1.08, 1.02,
    1.00, 0.98, 1.00, 1.06, 1.18, 1.38,
    1.55, 1.50, 1.32, 1.12, 1.00, 0.90,
)  # fmt: skip
_WEEKEND_LEVEL = {5: 0.85, 6: 0.75}  # Saturday, Sunday


def day_prices(rng: random.Random, date: dt.date) -> list[float]:
    """24 hourly prices (EUR/MWh, cents) for ``date``; the same ``rng`` state gives the same day."""
    # season: 1 in mid-January (winter demand, little sun), -1 in mid-July.
    season = math.cos(2 * math.pi * (date.timetuple().tm_yday - 15) / 365.25)
    weekend = _WEEKEND_LEVEL.get(date.weekday(), 1.0)
    wind = rng.betavariate(1.5, 3.0)  # 0 calm .. 1 storm; mostly light
    level = (75 + 20 * season) * weekend * math.exp(rng.gauss(0, 0.22)) * (1 - 0.45 * wind)
    sun = max(0.0, 0.55 - 0.35 * season + rng.gauss(0, 0.25))  # summer and clear skies: ~1
    # Solar generation drives midday prices down by a fixed-ish EUR amount, not a fraction of the
    # level: that is how a cheap day with a lot of sun gets negative prices.
    solar_eur = sun * (34 + 20 * wind) * (1.2 if weekend < 1 else 1.0)

    noise = 0.0
    prices = []
    for hour, shape in enumerate(_PROFILE):
        noise = 0.65 * noise + rng.gauss(0, 0.06)
        daylight = math.exp(-(((hour - 12.5) / 2.3) ** 2))
        price = level * (shape + noise) - solar_eur * daylight
        prices.append(price)

    if rng.random() < 0.05:  # scarcity: one or two peak hours clear far above the rest
        peak = rng.choice((7, 8, 17, 18, 19))
        for hour in (peak, peak + 1) if rng.random() < 0.4 else (peak,):
            prices[hour] = prices[hour] * rng.uniform(2.0, 5.0) + rng.uniform(50, 150)
    return [round(max(PRICE_FLOOR, p), 2) for p in prices]
