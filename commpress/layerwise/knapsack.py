"""The multiple-choice knapsack of a layer-wise plan: one setting per tensor, the least summed
error within a byte budget, by dynamic programming over *units* of bytes (costs rounded up, the
budget down: every plan fits, optimal up to that rounding). Ranks solving the same numbers get the
same choice."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["UNITS", "cheapest", "solve"]

#: How many units a budget is divided into: the DP's table has this many columns.
UNITS = 4096


def solve(
    costs: Sequence[Sequence[float]], errors: Sequence[Sequence[float]], budget: float, units: int = UNITS
) -> list[int] | None:
    """For each item ``t`` the chosen option's index, minimising ``sum(errors[t][c_t])`` with
    ``sum(costs[t][c_t]) <= budget`` (``units``: the budget's resolution); None when none fits."""
    if len(costs) != len(errors) or any(len(c) != len(e) or not c for c, e in zip(costs, errors)):
        raise ValueError("solve: every item needs one error per cost, and at least one option")
    if budget < 0 or not math.isfinite(budget):
        return None
    unit = max(1.0, math.ceil(budget / units))
    width = int(budget // unit)
    dp = np.zeros(width + 1)  # least error with cost <= b, no item yet
    choices = []
    for cost, error in zip(costs, errors):
        candidate = np.full((len(cost), width + 1), math.inf)  # row c: the least error with option c last
        for c, (w, e) in enumerate(zip(cost, error)):
            w = math.ceil(w / unit)
            if w <= width:
                np.add(dp[: width + 1 - w], float(e), out=candidate[c, w:])
        pick = candidate.argmin(axis=0)  # the first least: ties go to the lower index
        dp = candidate.min(axis=0)
        choices.append(pick)
    if not math.isfinite(dp[width]):
        return None
    out, b = [], width
    for cost, pick in zip(reversed(costs), reversed(choices)):
        c = int(pick[b])
        out.append(c)
        b -= math.ceil(cost[c] / unit)
    return out[::-1]


def cheapest(costs: Sequence[Sequence[float]]) -> list[int]:
    """Each item's least costly option (what a budget below every plan gets)."""
    return [min(range(len(c)), key=c.__getitem__) for c in costs]
