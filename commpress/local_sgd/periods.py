"""How many local steps a round of Local SGD lasts: a constant, or the Quadratic Synchronization
Rule (QSR, Gu et al., ICLR 2024), which lengthens rounds as the learning rate decays (H ~ 1/lr^2)."""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod

__all__ = ["QSR", "Constant", "Period", "qsr_period"]


def qsr_period(lr: float, alpha: float, h_base: int, power: float = 2) -> int:
    """The QSR round length for learning rate ``lr``: ``max(h_base, floor((alpha / lr) ** power))``."""
    if not lr > 0:
        raise ValueError(f"lr = {lr!r} is not accepted; expected a number > 0")
    if not alpha > 0:
        raise ValueError(f"alpha = {alpha!r} is not accepted; expected a number > 0")
    if h_base < 1:
        raise ValueError(f"h_base = {h_base!r} is not accepted; expected an integer >= 1")
    try:
        period = math.floor((alpha / lr) ** power)
    except OverflowError:  # a tiny lr: the round would outlast any run
        period = sys.maxsize
    return max(h_base, min(period, sys.maxsize))


class Period(ABC):
    """A policy that picks the length H of the next round when a round starts."""

    @abstractmethod
    def next(self, step: int, lr: float, remaining: int | None = None) -> int:
        """H for the round starting at ``step``, whose first step uses ``lr``; ``remaining``: steps left."""


class Constant(Period):
    """Average every ``h`` steps."""

    def __init__(self, h: int) -> None:
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"period h = {h!r} is not accepted; expected an integer >= 1")
        self.h = h

    def next(self, step: int, lr: float, remaining: int | None = None) -> int:
        return self.h

    def __repr__(self) -> str:
        return f"Constant({self.h})"


class QSR(Period):
    """Quadratic Synchronization Rule: ``H = max(h_base, floor((alpha / lr) ** power))``,
    ``h_base`` during the first ``warmup_steps`` steps, never past the last step."""

    def __init__(self, alpha: float, h_base: int, power: float = 2, warmup_steps: int = 0) -> None:
        qsr_period(1.0, alpha, h_base, power)  # validates alpha and h_base
        if not power > 0:
            raise ValueError(f"power = {power!r} is not accepted; expected a number > 0")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps = {warmup_steps!r} is not accepted; expected an integer >= 0")
        self.alpha, self.h_base, self.power, self.warmup_steps = alpha, h_base, power, warmup_steps

    def next(self, step: int, lr: float, remaining: int | None = None) -> int:
        left = remaining if remaining is not None and remaining > 0 else None
        if step < self.warmup_steps:
            h = self.h_base
        elif lr > 0:
            h = qsr_period(lr, self.alpha, self.h_base, self.power)
        else:  # lr = 0: nothing moves; one round to the end (or h_base if the end is unknown)
            h = self.h_base if left is None else left
        return h if left is None else min(h, left)

    def __repr__(self) -> str:
        return f"QSR(alpha={self.alpha}, h_base={self.h_base}, power={self.power}, warmup_steps={self.warmup_steps})"
