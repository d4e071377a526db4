"""FSDP2's layout of a model's parameters, for simulated ranks without a process group.

A unit per ``fully_shard``-ed module with parameters, in ``named_modules`` order, holds its
modules' parameters in post-order, not entering nested units; a rank's flat shard is every
parameter's dim-0 ``torch.chunk`` zero-padded to the first chunk's size, end to end.
``tests/test_quality_qsdp.py`` checks these rules against real FSDP2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from commpress.config.tables import FSDPConfig
from commpress.fsdp.fsdp2 import ParamShard, Unit

__all__ = ["PlannedUnit", "flat_shards", "plan_units", "shard_rows", "unshard"]


class PlannedUnit(NamedTuple):
    """A unit as :func:`~commpress.fsdp.fsdp2.apply_fsdp2` would make it, its parameters'
    positions in ``model.parameters()``, and whether it is the root's."""

    unit: Unit
    positions: tuple[int, ...]
    root: bool


def shard_rows(t: torch.Tensor, world: int) -> int:
    """Rows of one rank's shard of ``t`` (dim 0 cut as ``torch.chunk`` does)."""
    return -(-t.shape[0] // world)


def plan_units(model: torch.nn.Module, sharded: Sequence[str], config: FSDPConfig, world: int) -> list[PlannedUnit]:
    """The units after ``fully_shard`` on each module named in ``sharded`` and on ``model``."""
    modules = dict(model.named_modules())
    unknown = [name for name in sharded if name not in modules]
    if unknown:
        raise ValueError(f"FSDP units {unknown} are not modules of {type(model).__name__}")
    roots = {modules[name] for name in sharded} | {model}
    position = {id(p): i for i, p in enumerate(model.parameters())}
    names = {id(p): n for n, p in model.named_parameters()}
    units: list[PlannedUnit] = []
    for module in model.modules():
        if module not in roots:
            continue
        params: dict[int, torch.Tensor] = {}
        for m in _managed_modules(module, roots):
            for p in m.parameters(recurse=False):
                params.setdefault(id(p), p)
        if not params:
            continue
        shards = tuple(ParamShard(names[i], p.numel(), shard_rows(p, world) * math.prod(p.shape[1:])) for i, p in params.items())
        units.append(PlannedUnit(Unit(len(units), shards, config), tuple(position[i] for i in params), module is model))
    return units


def _managed_modules(module: torch.nn.Module, roots: set[torch.nn.Module]) -> list[torch.nn.Module]:
    """FSDP2's walk of one ``fully_shard``-ed module: post-order, stopping at other units."""
    out: list[torch.nn.Module] = []
    visited = {module}

    def walk(m: torch.nn.Module) -> None:
        for child in m.children():
            if child not in roots and child not in visited:
                visited.add(child)
                walk(child)
        out.append(m)

    walk(module)
    return out


def flat_shards(tensors: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    """``[world, n]``: row ``r`` is rank ``r``'s flat shard of ``tensors``."""
    parts = []
    for t in tensors:
        padded = t.new_zeros(shard_rows(t, world) * world, *t.shape[1:])
        padded[: t.shape[0]] = t
        parts.append(padded.view(world, -1))
    return torch.cat(parts, dim=1)


def unshard(rows: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of :func:`flat_shards`: full tensors shaped as ``like``, padding dropped."""
    world = rows.shape[0]
    out, pos = [], 0
    for t in like:
        width = shard_rows(t, world) * math.prod(t.shape[1:])
        out.append(rows[:, pos : pos + width].reshape(-1, *t.shape[1:])[: t.shape[0]])
        pos += width
    return out
