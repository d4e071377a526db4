"""The learning rate a benchmark trains with at each step: what users train with (a linear
warm-up, then cosine decay to a tenth at the end of the run, nanoGPT's ``get_lr``) or a
constant rate. A schedule changes what a method costs in quality (the end of a decayed run
is where compression noise shows), so races and quality runs report under one."""

from __future__ import annotations

import math
from dataclasses import dataclass

from commpress.errors import ConfigError

__all__ = ["SCHEDULES", "Schedule"]

SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class Schedule:
    """``cosine``: ``lr * (step + 1) / (warmup + 1)`` for the first ``warmup`` steps, then a
    cosine from ``lr`` down to ``lr * floor`` at ``steps``, ``lr * floor`` after it;
    ``constant``: ``lr`` at every step."""

    kind: str
    lr: float
    steps: int
    warmup: int = 0
    floor: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ConfigError(f"schedule = {self.kind!r} is not accepted; accepted: {', '.join(SCHEDULES)}")
        if not 0 <= self.warmup < self.steps:
            raise ConfigError(
                f"lr warm-up = {self.warmup} steps is not accepted; expected 0 <= warm-up < the run's {self.steps} steps"
            )

    def __call__(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        if self.kind == "constant":
            return self.lr
        if step < self.warmup:
            return self.lr * (step + 1) / (self.warmup + 1)
        low = self.lr * self.floor
        if step >= self.steps:
            return low
        angle = math.pi * (step - self.warmup) / (self.steps - self.warmup)
        return low + (self.lr - low) * 0.5 * (1 + math.cos(angle))

    def describe(self) -> str:
        """One line for a report's header."""
        if self.kind == "constant":
            return f"constant lr {self.lr:g}"
        return (
            f"lr {self.lr:g}: {self.warmup} warm-up steps, cosine to {self.lr * self.floor:g} at step {self.steps}"
        )
