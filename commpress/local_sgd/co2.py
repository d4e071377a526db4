"""CO2 (Sun et al., ICLR 2024): Local SGD whose averaging all-reduce runs in the background
during the next round, with an outer momentum update from the one-round-stale average.

At the end of round t (local model x_t, round anchor a_t), on every rank::

    d_t  = a_t - x_t                     start a non-blocking average of d_t
    D    = mean over ranks of d_{t-1}    wait for the previous round's average
    m    = clamp(beta * m + D / Lambda, -clip, clip)
    a_{t+1} = a_t - outer_lr * m         local models continue from a_{t+1}

the :class:`~commpress.local_sgd.outer.OuterStep` of Local SGD and DiLoCo with its
momentum, the penalty as the scale of D, and clipping; what differs is the timing: the
average lands a round late, and the local model restarts from the anchor at once.
``docs/local_sgd.md`` gives the equations, the staleness penalty Lambda and the defaults.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from commpress.config.tables import check_co2_settings
from commpress.errors import ConfigError
from commpress.local_sgd.averaging import ParameterAverager
from commpress.local_sgd.local_sgd import LocalSGD, check_finite
from commpress.local_sgd.outer import OuterStep
from commpress.local_sgd.periods import Period

__all__ = ["CO2"]


@dataclass
class _Pending:
    """A round's average in flight: the buffer it lands in and the anchor of that round."""

    future: torch.futures.Future
    buffer: torch.Tensor
    anchor: torch.Tensor | None  # kept only for the adaptive penalty


class CO2(LocalSGD):
    """CO2 with ``period`` local steps per round, outer learning rate ``outer_lr``, outer
    momentum ``outer_momentum`` (beta), ``staleness_penalty`` (a constant Lambda >= 1, or
    ``"adaptive"``: Lambda grows with the gap between the local models and the stale
    average) and element-wise outer momentum clipping to ``[-clip, clip]`` (None: off).

    ``wait_seconds`` records how long each sync point waited for the background average
    (near zero when the link keeps up with one round of compute); ``penalties`` each Lambda.
    Call :meth:`finish` at the end of training to apply the last average.
    """

    name = "CO2"

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        period: int | Period = 4,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        staleness_penalty: float | str = 1.0,
        clip: float | None = None,
        process_group: Any = None,
        averager: ParameterAverager | str | None = None,
        average_buffers: bool = False,
        total_steps: int | None = None,
    ) -> None:
        check_co2_settings(outer_lr, outer_momentum, staleness_penalty, clip)
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.staleness_penalty = staleness_penalty
        self.clip = None if clip is None else float(clip)
        super().__init__(model, inner_optimizer, period, process_group, averager, average_buffers, total_steps)
        if staleness_penalty == "adaptive" and not self.averager.backend.can_block:
            raise ConfigError(
                "staleness_penalty = 'adaptive' is not accepted with ranks simulated in one process: its blocking "
                "all-reduce at every sync point waits for ranks that run later; use a number >= 1"
            )
        self._pending: _Pending | None = None
        self.penalties: list[float] = []

    def _outer_step(self) -> OuterStep:
        """Momentum beta without Nesterov, clipped."""
        return OuterStep(self.anchor, self.outer_lr, self.outer_momentum, clip=self.clip)

    @property
    def momentum(self) -> torch.Tensor | None:
        """The outer momentum m (None at beta 0 without clipping: no state)."""
        return self.outer.momentum

    def _settings(self) -> dict[str, Any]:
        return {
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "staleness_penalty": self.staleness_penalty,
            "clip": self.clip,
        }

    def start_due(self, final: bool = False) -> None:
        """At the end of a round (``final``: of a round in progress): apply the previous
        round's average, start this round's in the background, restart from the anchor."""
        if not (self.clock.in_round if final else self.clock.round_ends):
            return
        self._check_ranks()
        local = self.flat.read()
        send = torch.sub(self.anchor, local)
        if self._pending is not None:
            self._apply(self._wait(), local)
        keep = self.anchor.clone() if self.staleness_penalty == "adaptive" else None
        self._pending = _Pending(self.averager.start(self.flat.bucket(send)), send, keep)
        self.flat.write(self.anchor)
        self.clock.round_done()

    def apply_due(self, final: bool = False) -> None:
        """Nothing lands during training (a round's average is applied at the next round's
        end); ``final``: wait for the last average and apply it."""
        if final and self._pending is not None:
            self._apply(self._wait(), self.flat.read())
            self.flat.write(self.anchor)

    def _wait(self) -> _Pending:
        pending, self._pending = self._pending, None
        assert pending is not None
        t0 = time.perf_counter()
        pending.future.wait()
        self.wait_seconds.append(time.perf_counter() - t0)
        return pending

    def _apply(self, pending: _Pending, local: torch.Tensor) -> None:
        """The outer update from the stale average ``D = pending.buffer``."""
        stale = pending.buffer
        check_finite(stale, self.name, self.clock.rounds - 1)
        penalty = self._penalty(stale, pending.anchor, local)
        self.penalties.append(penalty)
        self.outer.apply(self.anchor, stale, scale=1.0 / penalty)

    def _penalty(self, stale: torch.Tensor, stale_anchor: torch.Tensor | None, local: torch.Tensor) -> float:
        """Lambda: the constant, or max(1, rms over ranks of |x_local - x_stale_avg| / |D|)."""
        if self.staleness_penalty != "adaptive":
            return float(self.staleness_penalty)
        assert stale_anchor is not None
        gap = torch.linalg.vector_norm(local - (stale_anchor - stale), dtype=torch.float64).square().reshape(1)
        mean_gap = math.sqrt(self.averager.sum(gap).item() / self.averager.world_size)
        step = torch.linalg.vector_norm(stale, dtype=torch.float64).item()
        return max(1.0, mean_gap / step) if step > 0 else 1.0

    def _part(self) -> dict[str, Any]:
        """Adds the average in flight (waited for, so a restored run applies the same values
        at its next sync)."""
        state = super()._part()
        pending = None
        if self._pending is not None:
            self._pending.future.wait()
            pending = {
                "average": self._pending.buffer.clone(),
                "anchor": None if self._pending.anchor is None else self._pending.anchor.clone(),
            }
        state["pending"] = pending
        return state

    def _load_part(self, state: Mapping[str, Any]) -> None:
        super()._load_part(state)
        pending = state["pending"]
        self._pending = None
        if pending is not None:
            done: torch.futures.Future = torch.futures.Future()
            buffer = pending["average"].clone()
            done.set_result(buffer)
            anchor = None if pending["anchor"] is None else pending["anchor"].clone()
            self._pending = _Pending(done, buffer, anchor)
