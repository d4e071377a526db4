"""The ``[local_sgd]`` config table: Local SGD (constant period or QSR) or CO2, averaging
through the config's top-level ``method`` (e.g. ``bf16``)::

    method = "none"            # the compressor of the averaging all-reduce
    [local_sgd]
    algorithm = "local_sgd"    # or "co2"
    period = 4                 # H, or h_base when qsr_alpha is set
    qsr_alpha = 0.2            # QSR: H = max(period, floor((qsr_alpha / lr) ** qsr_power))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from commpress.config import Config, register_section
from commpress.errors import ConfigError
from commpress.local_sgd.averaging import ParameterAverager
from commpress.local_sgd.co2 import CO2, check_co2_settings
from commpress.local_sgd.local_sgd import LocalSGD
from commpress.local_sgd.periods import QSR, Constant, Period
from commpress.schema import parse_dataclass

__all__ = ["LocalSGDConfig", "from_config"]


@dataclass(frozen=True)
class LocalSGDConfig:
    """Settings of the ``[local_sgd]`` table (CO2 keys apply to ``algorithm = "co2"``)."""

    algorithm: Literal["local_sgd", "co2"] = "local_sgd"
    period: int = 4
    qsr_alpha: float | None = None
    qsr_power: float = 2.0
    warmup_steps: int = 0
    average_buffers: bool = False
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    staleness_penalty: float | Literal["adaptive"] = 1.0
    clip: float | None = None

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ConfigError(f"local_sgd: period = {self.period!r} is not accepted; expected an integer >= 1")
        if self.qsr_alpha is not None and not self.qsr_alpha > 0:
            raise ConfigError(f"local_sgd: qsr_alpha = {self.qsr_alpha!r} is not accepted; expected a number > 0")
        if not self.qsr_power > 0:
            raise ConfigError(f"local_sgd: qsr_power = {self.qsr_power!r} is not accepted; expected a number > 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"local_sgd: warmup_steps = {self.warmup_steps!r} is not accepted; expected an integer >= 0")
        try:
            check_co2_settings(self.outer_lr, self.outer_momentum, self.staleness_penalty, self.clip)
        except ConfigError as exc:
            raise ConfigError(f"local_sgd: {exc}") from None

    def period_policy(self) -> Period:
        """Constant(period), or QSR with h_base = period when qsr_alpha is set."""
        if self.qsr_alpha is None:
            return Constant(self.period)
        return QSR(self.qsr_alpha, self.period, self.qsr_power, self.warmup_steps)


def _parse(data: Mapping[str, Any]) -> LocalSGDConfig:
    return parse_dataclass("local_sgd", LocalSGDConfig, data)


register_section("local_sgd", _parse)


def from_config(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config | Mapping[str, Any] | str,
    total_steps: int | None = None,
    process_group: Any = None,
) -> LocalSGD:
    """A :class:`LocalSGD` or :class:`CO2` for ``model`` from a config with a ``[local_sgd]``
    table; its top-level ``method`` and ``params`` choose the averaging compressor."""
    cfg = Config.load(config)
    section = cfg.section("local_sgd")
    if section is None:
        raise ConfigError("the config has no [local_sgd] table")
    if cfg.overrides:
        raise ConfigError("overrides are not accepted with [local_sgd]: the whole model is averaged with one method")
    if cfg.start_iter:
        raise ConfigError(f"start_iter = {cfg.start_iter} is not accepted with [local_sgd]; use local_sgd.warmup_steps (QSR)")
    group = process_group if process_group is not None or cfg.backend != "torch" else getattr(model, "process_group", None)
    averager = ParameterAverager(cfg.method, cfg.params, process_group=group, backend=cfg.backend)
    common = {"averager": averager, "average_buffers": section.average_buffers, "total_steps": total_steps}
    if section.algorithm == "local_sgd":
        return LocalSGD(model, optimizer, section.period_policy(), **common)
    return CO2(
        model,
        optimizer,
        section.period_policy(),
        outer_lr=section.outer_lr,
        outer_momentum=section.outer_momentum,
        staleness_penalty=section.staleness_penalty,
        clip=section.clip,
        **common,
    )
