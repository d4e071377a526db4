"""DiLoCo (Douillard et al., 2023) and Streaming DiLoCo (Douillard et al., 2025): Local SGD
whose outer step is SGD with Nesterov momentum on the averaged pseudo-gradient, optionally
synced fragment by fragment, each fragment's average landing ``sync_delay`` inner steps
after it started and merged into the local values with ``merge_alpha``.

The schedule, with period H and F fragments: a round is H / F steps and ends with the sync
of fragment ``rounds % F``, so each fragment is synced once every H steps, fragment f at
steps ``(f + 1) * H / F + k * H``; its average lands ``sync_delay`` (tau) steps later, where
``local = alpha * local + (1 - alpha) * anchor`` for that fragment (alpha 0: the anchor).
``docs/local_sgd.md`` has the equations and the defaults.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from commpress.config.tables import check_diloco_settings, check_streaming
from commpress.errors import ConfigError
from commpress.local_sgd.averaging import ParameterAverager
from commpress.local_sgd.local_sgd import LocalSGD
from commpress.local_sgd.outer import OuterStep
from commpress.local_sgd.periods import Constant, Period

__all__ = ["DiLoCo"]


class DiLoCo(LocalSGD):
    """DiLoCo with ``period`` (H) inner steps per outer step, outer SGD with learning rate
    ``outer_lr``, momentum ``outer_momentum`` and ``nesterov`` (the paper's 0.7, 0.9,
    Nesterov); ``fragments`` (F), ``sync_delay`` (tau) and ``merge_alpha`` (alpha) make
    it Streaming DiLoCo, which needs a constant H divisible by F and tau < H / F.

    ``averager`` compresses the pseudo-gradients (any commpress method, its error
    feedback kept per fragment across rounds). Call :meth:`finish` at the end of training:
    it lands what is in flight and syncs every fragment changed since, so every rank ends
    with the same model.
    """

    name = "DiLoCo"

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        period: int | Period = 100,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fragments: int = 1,
        sync_delay: int = 0,
        merge_alpha: float = 0.0,
        process_group: Any = None,
        averager: ParameterAverager | str | None = None,
        average_buffers: bool = False,
        total_steps: int | None = None,
    ) -> None:
        check_diloco_settings(outer_lr, outer_momentum, nesterov, fragments, sync_delay, merge_alpha)
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        self.fragment_count, self.sync_delay, self.merge_alpha = fragments, sync_delay, float(merge_alpha)
        self.outer_period = period
        if fragments > 1 or sync_delay > 0:
            h = period.h if isinstance(period, Constant) else period if isinstance(period, int) else None
            try:
                check_streaming(h, fragments, sync_delay)
            except ConfigError as exc:
                raise ConfigError(f"{self.name}: {exc}") from None
            period = Constant(h // fragments)
        super().__init__(model, inner_optimizer, period, process_group, averager, average_buffers, total_steps)

    def _settings(self) -> dict[str, Any]:
        return {
            "outer_period": repr(self.outer_period),
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "nesterov": self.nesterov,
            "fragments": self.fragment_count,
            "sync_delay": self.sync_delay,
            "merge_alpha": self.merge_alpha,
        }

    def _outer_step(self) -> OuterStep:
        return OuterStep(self.anchor, self.outer_lr, self.outer_momentum, self.nesterov)
