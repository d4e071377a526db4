"""DiLoCo (Douillard et al., 2023) and Streaming DiLoCo (Douillard et al., 2025): Local SGD
whose outer optimizer is Nesterov SGD on the averaged pseudo-gradient, optionally synced
fragment by fragment, each average landing ``sync_delay`` (tau) inner steps after it started.

With period H and F fragments a round is H / F steps and ends with the sync of fragment
``rounds % F``, so each fragment syncs once every H steps. ``merge = "eager"``: when a sync
starts, the fragment's local values move to ``anchor + outer_lr * (local - anchor)`` (where the
outer step will move the anchor), and when it lands they become ``new anchor + (local - those
values)``, keeping the tau steps. ``"mix"`` (the paper's): ``local = alpha * local + (1 -
alpha) * anchor``. ``docs/local_sgd.md`` has the equations and the defaults.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from commpress.comm.averager import ParameterAverager
from commpress.config.tables import REPLICA_OUTER_LRS, check_diloco_settings, check_streaming, resolve_merge
from commpress.errors import ConfigError
from commpress.local_sgd.average import InFlight
from commpress.local_sgd.fragments import Fragment
from commpress.local_sgd.local_sgd import LocalSGD
from commpress.local_sgd.outer import OuterOptimizer, check_outer_arguments
from commpress.local_sgd.periods import Constant, Period

__all__ = ["DiLoCo"]


class DiLoCo(LocalSGD):
    """DiLoCo with ``period`` (H) inner steps per outer step. ``outer_optimizer`` builds the outer
    optimizer from the anchor's tensors (one per fragment); left None, it is SGD with ``outer_lr``
    (a number, or a rule of :data:`~commpress.config.tables.REPLICA_OUTER_LRS`),
    ``outer_momentum`` and ``nesterov``. ``fragments`` (F), ``sync_delay`` (tau) and ``merge``
    (``"eager"`` unless ``merge_alpha`` is given) make it Streaming DiLoCo, which needs a constant
    H divisible by F and tau < H / F. ``averager``'s error feedback is kept per fragment."""

    name = "DiLoCo"
    algorithm = "diloco"

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        period: int | Period | None = None,
        outer_lr: float | str | None = None,
        outer_momentum: float | None = None,
        nesterov: bool | None = None,
        fragments: int | None = None,
        sync_delay: int | None = None,
        merge_alpha: float | None = None,
        merge: str | None = None,
        process_group: Any = None,
        averager: ParameterAverager | str | None = None,
        average_buffers: bool = False,
        total_steps: int | None = None,
        outer_optimizer: OuterOptimizer | None = None,
        key: str | None = None,
    ) -> None:
        outer = {"outer_lr": outer_lr, "outer_momentum": outer_momentum, "nesterov": nesterov}
        check_outer_arguments(self.name, outer_optimizer, outer)
        self.merge, alpha = resolve_merge(merge, merge_alpha)
        streaming = {"fragments": fragments, "sync_delay": sync_delay, "merge_alpha": alpha}
        values = {k: self.default(k) if v is None else v for k, v in {**outer, **streaming}.items()}
        check_diloco_settings(*values.values())
        given = values["outer_lr"]
        #: as given: a number, or a name of REPLICA_OUTER_LRS (``outer_lr`` set once the averager knows its world)
        self.outer_lr_setting: float | str = given if given in REPLICA_OUTER_LRS else float(given)
        self.outer_lr = 1.0 if given in REPLICA_OUTER_LRS else float(given)
        self.outer_momentum = float(values["outer_momentum"])
        self.nesterov = bool(values["nesterov"])
        self.fragment_count, self.sync_delay = values["fragments"], values["sync_delay"]
        self.merge_alpha = float(values["merge_alpha"])
        self.outer_period = self.default("period") if period is None else period
        self._given_outer = outer_optimizer
        super().__init__(model, inner_optimizer, self.outer_period, process_group, averager, average_buffers, total_steps, key)
        self._follow_participants()

    def _round_period(self, period: int | Period) -> int | Period:
        """Streaming: a round of H / F steps ends with one fragment's sync."""
        if self.fragment_count == 1 and self.sync_delay == 0:
            return period
        h = period.h if isinstance(period, Constant) else period if isinstance(period, int) else None
        try:
            check_streaming(h, self.fragment_count, self.sync_delay)
        except ConfigError as exc:
            raise ConfigError(f"{self.name}: {exc}") from None
        assert h is not None
        return Constant(h // self.fragment_count)

    def _outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """SGD as the paper steps it (torch's Nesterov, dampening 0)."""
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.nesterov)

    def _follow_participants(self) -> None:
        """With a rule of :data:`REPLICA_OUTER_LRS`, the outer lr for M, the ranks (replica groups)
        averaging: under a torchft Manager this sync's, the same on every replica of the quorum."""
        if self.outer_lr_setting not in REPLICA_OUTER_LRS:
            return
        self.outer_lr = REPLICA_OUTER_LRS[self.outer_lr_setting](self.averager.world_size)
        for group in self.outer_optimizer.param_groups:
            group["lr"] = self.outer_lr

    def _settings(self) -> dict[str, Any]:
        outer = {"outer_lr": self.outer_lr_setting, "outer_momentum": self.outer_momentum, "nesterov": self.nesterov}
        streaming = {"fragments": self.fragment_count, "sync_delay": self.sync_delay, "merge": self.merge}
        if self.merge == "mix":
            streaming["merge_alpha"] = self.merge_alpha
        return {"outer_period": repr(self.outer_period), **self._outer_settings(outer), **streaming}

    def _eager_move(self, fragment: Fragment, anchor: torch.Tensor, local: torch.Tensor) -> torch.Tensor | None:
        """``merge = "eager"``: where a delayed sync moves the local values when it starts."""
        return torch.lerp(anchor, local, self._outer_lr(fragment.index)) if self.merge == "eager" else None

    def _outer_lr(self, index: int) -> float:
        """The outer optimizer's lr for ``outer_params[index]``."""
        param = self.outer_params[index]
        return next(float(g["lr"]) for g in self.outer_optimizer.param_groups if any(p is param for p in g["params"]))

    def _merge(self, flight: InFlight) -> None:
        """The new anchor plus the steps taken since the eager move, or a mix with the anchor."""
        where, tensors = flight.fragment.where, flight.fragment.tensors
        local = self.flat.read(tensors=tensors)
        if flight.start is not None:
            local.sub_(flight.start).add_(self.anchor[where])
        else:
            local.mul_(self.merge_alpha).add_(self.anchor[where], alpha=1 - self.merge_alpha)
        self.flat.write(local, tensors)
        self.fresh[flight.fragment.index] = -1

    def _skip_sync(self, flight: InFlight) -> None:
        """As :meth:`LocalSGD._skip_sync`, and an eager move made at the sync's start is undone
        (``start - anchor`` divided by the outer lr; an outer lr of 0 moved nothing: the anchor)."""
        if flight.start is None:
            return
        fragment = flight.fragment
        lr = self._outer_lr(fragment.index)
        if lr == 0:
            self._to_anchor(fragment)
            return
        local = self.flat.read(tensors=fragment.tensors)
        local.sub_(flight.start).add_(torch.lerp(self.anchor[fragment.where], flight.start, 1 / lr))  # the values before the move
        self.flat.write(local, fragment.tensors)
        self.fresh[fragment.index] = -1
