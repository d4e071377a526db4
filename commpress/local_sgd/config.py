"""Local SGD, CO2 or DiLoCo trainers from the ``[local_sgd]`` config table, averaging through the
config's top-level ``method``::

    method = "none"            # the compressor of the averaging all-reduce
    [local_sgd]
    algorithm = "local_sgd"    # or "co2", "diloco"
    period = 4                 # H, or h_base when qsr_alpha is set
    qsr_alpha = 0.2            # QSR: H = max(period, floor((qsr_alpha / lr) ** qsr_power))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from commpress.comm.averager import ParameterAverager
from commpress.comm.mesh import replica_groups
from commpress.config import Config
from commpress.config.matrix import check_part, model_kind
from commpress.config.tables import LocalSGDConfig
from commpress.errors import ConfigError
from commpress.local_sgd.co2 import CO2, check_penalty
from commpress.local_sgd.diloco import DiLoCo
from commpress.local_sgd.local_sgd import LocalSGD
from commpress.local_sgd.periods import QSR, Constant, Period
from commpress.local_sgd.trainer import Trainer
from commpress.local_sgd.warm import load_trainer_kernels

__all__ = ["LocalSGDConfig", "build_trainer", "from_config", "period_policy", "trainer_for"]

ENTRY = "commpress.local_sgd.from_config"


def period_policy(section: LocalSGDConfig) -> Period:
    """Constant(period), or QSR with h_base = period when qsr_alpha is set."""
    if section.qsr_alpha is None:
        return Constant(section.period)
    return QSR(section.qsr_alpha, section.period, section.qsr_power, section.warmup_steps)


def from_config(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config | Mapping[str, Any] | str,
    total_steps: int | None = None,
    process_group: Any = None,
    mesh: Any = None,
    manager: Any = None,
    key: str | None = None,
) -> Trainer:
    """The trainer a config's ``[local_sgd]`` table describes for ``model``. ``mesh``: a 2-D mesh
    (:mod:`commpress.comm.mesh`), each rank averaging its shard over ``mesh["replicate"]``;
    ``manager``: a ``torchft.Manager`` every sync goes through, its shared state under ``key``."""
    cfg = Config.load(config)
    if cfg.section("local_sgd") is None:
        raise ConfigError("the config has no [local_sgd] table")
    managed = manager is not None
    check_part(cfg, "local_sgd", ENTRY, model_kind(model, cfg.backend, mesh, managed), managed=managed)
    return build_trainer(model, optimizer, cfg, total_steps, process_group, mesh, manager, key)


def build_trainer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: Config,
    total_steps: int | None = None,
    process_group: Any = None,
    mesh: Any = None,
    manager: Any = None,
    key: str | None = None,
) -> Trainer:
    """:func:`from_config` of a config the matrix has accepted (:func:`commpress.register`'s part)."""
    section = cfg.section("local_sgd")
    assert section is not None
    managed = manager is not None
    if section.algorithm == "co2":
        check_penalty(section.value("staleness_penalty"), True, not managed)
    if mesh is not None:
        if process_group is not None:
            raise ConfigError(f"{ENTRY}: process_group is not accepted with mesh=; expected None (mesh['replicate'] is used)")
        process_group = replica_groups(mesh, model, ENTRY).replicate
    if managed:
        averager = ParameterAverager(cfg.method, cfg.params, manager=manager)
    else:
        group = cfg.group_for(model, process_group)
        averager = ParameterAverager(cfg.method, cfg.params, process_group=group, backend=cfg.backend)
    trainer = trainer_for(model, optimizer, section, averager, total_steps, key)
    load_trainer_kernels(trainer)
    return trainer


def trainer_for(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    section: LocalSGDConfig,
    averager: ParameterAverager,
    total_steps: int | None = None,
    key: str | None = None,
) -> Trainer:
    """The trainer the ``[local_sgd]`` table ``section`` describes, averaging through ``averager``."""
    common = {"averager": averager, "average_buffers": section.average_buffers, "total_steps": total_steps, "key": key}
    period = period_policy(section)
    if section.algorithm == "local_sgd":
        return LocalSGD(model, optimizer, period, **common)
    outer = {"outer_lr": section.value("outer_lr"), "outer_momentum": section.value("outer_momentum")}
    if section.algorithm == "diloco":
        keys = ("nesterov", "fragments", "sync_delay")
        merge = {"merge": section.merge, "merge_alpha": section.merge_alpha}  # as given: DiLoCo resolves them
        return DiLoCo(model, optimizer, period, **outer, **{k: section.value(k) for k in keys}, **merge, **common)
    co2 = {"staleness_penalty": section.value("staleness_penalty"), "clip": section.clip}
    return CO2(model, optimizer, period, **outer, **co2, **common)
