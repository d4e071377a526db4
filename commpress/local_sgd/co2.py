"""CO2 (Sun et al., ICLR 2024): Local SGD whose averaging all-reduce runs in the background
during the next round, with an outer momentum update from the one-round-stale average.

At the end of round t (local model x_t, round anchor a_t), on every rank::

    d_t  = a_t - x_t                     start a non-blocking average of d_t
    D    = mean over ranks of d_{t-1}    wait for the previous round's average
    m    = clamp(beta * m + D / Lambda, -clip, clip)
    a_{t+1} = a_t - outer_lr * m         local models continue from a_{t+1}

``docs/local_sgd.md`` gives the equations, the staleness penalty Lambda and the defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from commpress.comm.averager import ParameterAverager
from commpress.config.tables import check_co2_settings
from commpress.errors import ConfigError
from commpress.local_sgd.average import Average
from commpress.local_sgd.outer import OuterOptimizer, check_outer_arguments
from commpress.local_sgd.periods import Period
from commpress.local_sgd.trainer import Trainer

__all__ = ["CO2", "ClippedSGD", "check_penalty"]


def check_penalty(penalty: float | str, can_block: bool, fixed_members: bool) -> None:
    """Refuse ``staleness_penalty = 'adaptive'`` where its blocking all-reduce at every sync
    point cannot run: ranks simulated in one thread, or between two torchft manager steps."""
    if penalty != "adaptive" or (can_block and fixed_members):
        return
    where = "with ranks simulated in one process" if fixed_members else "under a torchft Manager"
    why = "waits for ranks that run later" if fixed_members else "would run between two manager steps"
    raise ConfigError(
        f"CO2: staleness_penalty = 'adaptive' is not accepted {where}: its blocking all-reduce at every sync point "
        f"{why}; use a number >= 1"
    )


class ClippedSGD(torch.optim.Optimizer):
    """SGD with momentum whose buffer is clipped element-wise after each update, CO2's
    outer step: ``m = clamp(momentum * m + grad, -clip, clip)``, ``param -= lr * m``."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float, clip: float) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "clip": clip})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                m.mul_(group["momentum"]).add_(p.grad).clamp_(-group["clip"], group["clip"])
                p.sub_(m, alpha=group["lr"])


class CO2(Trainer):
    """CO2 with ``period`` local steps per round, outer lr ``outer_lr``, outer momentum
    ``outer_momentum`` (beta), ``staleness_penalty`` (a constant Lambda >= 1, or ``"adaptive"``:
    growing with the gap between the local models and the stale average) and the outer momentum
    clipped to ``[-clip, clip]`` (None: off); ``outer_optimizer`` replaces the outer SGD and those
    three. ``penalties`` records each Lambda. Under a torchft Manager a sync that does not commit
    drops its outer step and the round's pseudo-gradient (the model restarted from the anchor)."""

    name = "CO2"
    algorithm = "co2"

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        period: int | Period | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        staleness_penalty: float | str | None = None,
        clip: float | None = None,
        process_group: Any = None,
        averager: ParameterAverager | str | None = None,
        average_buffers: bool = False,
        total_steps: int | None = None,
        outer_optimizer: OuterOptimizer | None = None,
        key: str | None = None,
    ) -> None:
        outer = {"outer_lr": outer_lr, "outer_momentum": outer_momentum, "clip": clip}
        check_outer_arguments(self.name, outer_optimizer, outer)
        lr = self.default("outer_lr") if outer_lr is None else outer_lr
        momentum = self.default("outer_momentum") if outer_momentum is None else outer_momentum
        self.staleness_penalty = self.default("staleness_penalty") if staleness_penalty is None else staleness_penalty
        check_co2_settings(lr, momentum, self.staleness_penalty, clip)  # before float(): a clear error for any value
        self.outer_lr, self.outer_momentum = float(lr), float(momentum)
        self.clip = None if clip is None else float(clip)
        self._given_outer = outer_optimizer
        super().__init__(model, inner_optimizer, period, process_group, averager, average_buffers, total_steps, key)
        check_penalty(self.staleness_penalty, self.averager.can_block, self.backend.fixed_members)
        self.penalties: list[float] = []

    def _no_syncs(self) -> None:
        self._pending: Average | None = None
        #: the landed average of the sync in flight (None: dropped), once asked at a heal or a save
        self._landed: tuple[torch.Tensor | None] | None = None
        self._pending_anchor: torch.Tensor | None = None  # the pending round's anchor, for the adaptive penalty

    def _outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """Momentum SGD without Nesterov (clipped: :class:`ClippedSGD`)."""
        if self.clip is None:
            return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum)
        return ClippedSGD(params, self.outer_lr, self.outer_momentum, self.clip)

    @property
    def momentum(self) -> torch.Tensor | None:
        """The outer momentum m (None before the first outer step, and without momentum)."""
        return self.outer_optimizer.state.get(self.anchor, {}).get("momentum_buffer")

    def _settings(self) -> dict[str, Any]:
        outer = self._outer_settings({"outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum, "clip": self.clip})
        return {**outer, "staleness_penalty": self.staleness_penalty}

    def start_due(self, final: bool = False) -> None:
        """At a round's end (``final``: of one in progress): apply the previous round's average,
        restart from the anchor, start this round's sync; a healing replica lands it at once."""
        if not (self.clock.in_round if final else self.clock.round_ends):
            return
        local = self.flat.read()
        send = torch.sub(self.anchor, local)
        if self._pending is not None:
            self._apply(local)  # waits before this round's average starts: one in flight at a time
        self.flat.write(self.anchor)  # before the quorum: a healing peer reads these values
        self._begin_sync()
        self._pending = self._start_average(send, self.flat.bucket)
        self._pending_anchor = self.anchor.clone() if self.staleness_penalty == "adaptive" else None
        if not self.backend.participating:
            self._decide_now()
            self.flat.write(self.anchor)  # the peer's
        self.clock.round_done()

    def apply_due(self, final: bool = False) -> None:
        """Nothing lands here during training; ``final``: wait for the last average and apply it."""
        if final and self._pending is not None:
            self._apply(self.flat.read())
            self.flat.write(self.anchor)

    def _apply(self, local: torch.Tensor) -> None:
        """The outer step from the stale average if its sync counts (asked now, or at a heal or save)."""
        pending, self._pending = self._pending, None
        assert pending is not None
        verdict = None if self._landed is not None else self.transaction.ask(lambda: self._wait(pending))
        with self.transaction.lock:  # the compressor's state and the anchor change together for a reading peer
            (average,) = self._landed if verdict is None else (self._keep_or_drop(*verdict),)
            self._landed = None
            self._step(average, local)

    def _decide_now(self) -> None:
        """Ask now whether the sync in flight counts, and keep its average for the round's end."""
        pending = self._pending
        assert pending is not None
        verdict = self.transaction.ask(lambda: self._wait(pending))
        with self.transaction.lock:
            self._landed = (self._keep_or_drop(*verdict),)

    def _keep_or_drop(self, average: torch.Tensor | None, finite: bool, committed: bool) -> torch.Tensor | None:
        """Settle the compressor's staged state; the average to apply (None: dropped, as is a non-finite one)."""
        counts = committed and average is not None
        self.transaction.settle(counts)
        return average if counts else None

    def _step(self, stale: torch.Tensor | None, local: torch.Tensor) -> None:
        """The outer step from the stale average ``D`` scaled by the staleness penalty (None: no step)."""
        if stale is None:
            return
        penalty = self._penalty(stale, self._pending_anchor, local)
        self.penalties.append(penalty)
        if penalty != 1.0:
            stale.mul_(1.0 / penalty)
        self.outer_step(0, stale)

    def _penalty(self, stale: torch.Tensor, stale_anchor: torch.Tensor | None, local: torch.Tensor) -> float:
        """Lambda: the constant, or max(1, rms over ranks of |x_local - x_stale_avg| / |D|)."""
        if self.staleness_penalty != "adaptive":
            return float(self.staleness_penalty)
        assert stale_anchor is not None
        gap = torch.linalg.vector_norm(local - (stale_anchor - stale), dtype=torch.float64).square().reshape(1)
        mean_gap = math.sqrt(self.averager.sum(gap).item() / self.averager.world_size)
        step = torch.linalg.vector_norm(stale, dtype=torch.float64).item()
        return max(1.0, mean_gap / step) if step > 0 else 1.0

    def _syncs_part(self) -> dict[str, Any]:
        """The average in flight, asked first whether it counts: saved if so, applied at the next round's end."""
        if self._pending is not None and self._landed is None:
            self._decide_now()
        if self._landed is not None and self._landed[0] is None:  # dropped: nothing to apply
            self._pending, self._landed = None, None
        pending = None
        if self._pending is not None:
            anchor = self._pending_anchor
            pending = {"average": self._pending.buffer.clone(), "anchor": None if anchor is None else anchor.clone()}
        return {"pending": pending}

    def _load_syncs(self, part: Mapping[str, Any]) -> None:
        pending = part["pending"]
        self._no_syncs()
        if pending is not None:
            self._pending = Average.landed(pending["average"].clone(), self.clock.rounds - 1)
            self._pending_anchor = None if pending["anchor"] is None else pending["anchor"].clone()
            self._landed = (self._pending.buffer,)
