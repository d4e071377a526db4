"""The step counter of Local SGD and CO2: which step ends the current round, and H."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from commpress.local_sgd.periods import Constant, Period

__all__ = ["RoundClock"]

log = logging.getLogger("commpress.local_sgd")


class RoundClock:
    """Counts steps and rounds. H is chosen at a round's first step, from the lr that step uses, so
    a scheduler stepped after the optimizer and an lr set by hand before the step are both seen."""

    def __init__(self, period: int | Period, total_steps: int | None = None, name: str = "local SGD") -> None:
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps = {total_steps!r} is not accepted; expected an integer >= 1 or None")
        self.policy = period if isinstance(period, Period) else Constant(period)  # an int means Constant
        self.total_steps = total_steps
        self.name = name
        self.step = 0  # optimizer steps taken
        self.rounds = 0  # rounds completed (averagings)
        self.period: int | None = None  # H of the current round; None until its first step
        self.round_start = 0
        self.periods: list[int] = []  # H of every round started

    def begin_step(self, lr: float) -> None:
        """Call before each optimizer step with the learning rate that step uses."""
        if self.period is not None:
            return
        remaining = self.total_steps - self.step if self.total_steps is not None else None
        self.period = self.policy.next(self.step, lr, remaining)
        self.round_start = self.step
        self.periods.append(self.period)
        log.info("%s round %d: H = %d local steps from step %d (lr %.4g)", self.name, self.rounds, self.period, self.step, lr)

    def end_step(self) -> bool:
        """Count the step just taken; True when it ends the round (time to average)."""
        self.step += 1
        return self.round_ends

    @property
    def round_ends(self) -> bool:
        """The step just taken ends the current round."""
        return self.period is not None and self.step >= self.round_start + self.period

    def round_done(self) -> None:
        """An averaging happened: the next step starts a new round."""
        self.rounds += 1
        self.period = None

    @property
    def in_round(self) -> bool:
        """Steps were taken since the last averaging."""
        return self.period is not None and self.step > self.round_start

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rounds": self.rounds,
            "period": self.period,
            "round_start": self.round_start,
            "periods": list(self.periods),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.rounds = int(state["rounds"])
        self.period = None if state["period"] is None else int(state["period"])
        self.round_start = int(state["round_start"])
        self.periods = [int(h) for h in state["periods"]]
