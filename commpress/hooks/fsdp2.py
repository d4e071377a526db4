"""Install commpress's quantized collectives on FSDP2 (``fully_shard``) modules.

Every ``fully_shard``-ed module (one parameter group) becomes a :class:`Unit` with a
:class:`QuantizedAllGather` (weights) and a :class:`QuantizedReduceScatter` (gradients),
set through FSDP2's public ``set_custom_all_gather`` / ``set_custom_reduce_scatter``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from commpress.hooks.fsdp2_grads import QuantizedReduceScatter
from commpress.hooks.fsdp2_unit import ParamShard, Unit
from commpress.hooks.fsdp2_weights import QuantizedAllGather
from commpress.hooks.fsdp_config import FSDPConfig

__all__ = ["FSDP2State", "apply_fsdp2"]


class FSDP2State:
    """What :func:`apply_fsdp2` installed: one :class:`Unit` per sharded module, the bytes
    each side sent, and the stochastic-rounding step counters (save them with a checkpoint
    so a resumed run draws the same random numbers)."""

    def __init__(self, config: FSDPConfig, units: list[Unit]) -> None:
        self.config = config
        self.units = units

    def traffic(self) -> dict[str, dict[str, float]]:
        """Bytes this rank contributed, collectives and compression seconds, per side:
        ``{"all_gather": {...}, "reduce_scatter": {...}}``."""
        out = {}
        for side, attr in (("all_gather", "gather_traffic"), ("reduce_scatter", "scatter_traffic")):
            snaps = [getattr(u, attr).snapshot() for u in self.units]
            out[side] = {k: sum(s[k] for s in snaps) for k in ("bytes_sent", "collectives", "compute_seconds")}
        return out

    def reset_traffic(self) -> None:
        for unit in self.units:
            unit.gather_traffic.reset()
            unit.scatter_traffic.reset()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": [u.steps for u in self.units]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = list(state["steps"])
        if len(steps) != len(self.units):
            raise ValueError(f"state has {len(steps)} FSDP units, this model has {len(self.units)}")
        for unit, step in zip(self.units, steps):
            unit.steps = int(step)


def _fsdp_modules(module: torch.nn.Module, recurse: bool) -> Iterator[tuple[str, FSDPModule]]:
    if not recurse:
        if not isinstance(module, FSDPModule):
            raise TypeError(f"expected a module sharded with fully_shard (an FSDPModule), got {type(module).__name__}")
        yield "", module
        return
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            yield name, sub


def apply_fsdp2(
    module: torch.nn.Module,
    config: FSDPConfig,
    *,
    recurse: bool = True,
    root: torch.nn.Module | None = None,
) -> FSDP2State:
    """Quantize the all-gather and reduce-scatter of ``module`` (and, with ``recurse``, of
    every ``fully_shard``-ed module inside it). Parameter names for ``config.exclude``
    are taken relative to ``root`` (default: ``module``)."""
    names = {id(p): n for n, p in (root if root is not None else module).named_parameters()}
    units: list[Unit] = []
    for where, fsdp_module in _fsdp_modules(module, recurse):
        groups = fsdp_module._get_fsdp_state()._fsdp_param_groups
        if not groups:
            continue
        if len(groups) > 1:
            raise ValueError(
                f"module {where or type(module).__name__!r} has {len(groups)} FSDP parameter groups (per-parameter "
                "meshes from shard_placement_fn); FSDP2's custom collectives apply to a whole module, so commpress "
                "cannot quantize it: call fully_shard separately on the submodules whose parameters share a mesh, "
                "or apply commpress to the other modules only (commpress.fsdp.apply(submodule, config, recurse=False))"
            )
        params = []
        for fp in groups[0].fsdp_params:
            if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
                raise ValueError(
                    f"parameter {names.get(id(fp.sharded_param), fp._param_fqn)!r} has its own FSDP all-gather "
                    "extension (fsdp_pre_all_gather); commpress cannot quantize it as well: leave its module out"
                )
            name = names.get(id(fp.sharded_param)) or fp._param_fqn or ""
            params.append(ParamShard(name, math.prod(fp._orig_size), fp._sharded_param_data.numel()))
        unit = Unit(len(units), tuple(params), config)
        fsdp_module.set_custom_all_gather(QuantizedAllGather(unit))
        fsdp_module.set_custom_reduce_scatter(QuantizedReduceScatter(unit))
        units.append(unit)
    return FSDP2State(config, units)
