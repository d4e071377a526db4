"""The open step's finiteness flags, one per bucket, and its reductions in flight."""

from __future__ import annotations

import threading

import torch

__all__ = ["StepFlags", "step_was_finite"]


class StepFlags:
    """One flag per bucket of the open step, collected once nothing is in flight."""

    def __init__(self) -> None:
        self._flags: list[torch.Tensor] = []
        self.in_flight = 0  # reductions whose completion callback has not run yet
        self._done = threading.Condition()  # guards both (callbacks run on comm threads)

    def started(self) -> None:
        """A bucket's reduction started: its flag comes with :meth:`landed`."""
        with self._done:
            self.in_flight += 1

    def landed(self, flag: torch.Tensor) -> None:
        with self._done:
            self._flags.append(flag)
            self.in_flight -= 1
            self._done.notify_all()

    def add(self, flag: torch.Tensor) -> None:
        """A flag of the step's own (a step the backend did not commit: False)."""
        with self._done:
            self._flags.append(flag)

    def collect(self) -> list[torch.Tensor]:
        """Once no reduction is in flight, the step's flags (and none left)."""
        with self._done:
            self._done.wait_for(lambda: self.in_flight == 0)
            flags, self._flags = self._flags, []
            return flags


def step_was_finite(flags: list[torch.Tensor]) -> bool:
    """Whether every bucket's average was finite: the one host transfer per step."""
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all().item())
