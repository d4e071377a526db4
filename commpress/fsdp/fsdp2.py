"""Install commpress's quantized collectives on FSDP2 (``fully_shard``) modules: each becomes a
:class:`Unit` with a :class:`QuantizedAllGather` and a :class:`QuantizedReduceScatter`.

Weights (QSDP): each rank's stochastically quantized shard is all-gathered and every rank
uses the dequantized shards, its own included, so all compute with the same weights; the
master shard stays full precision. Gradients: each rank quantizes every row of the flat input
with its own seed and an all-to-all delivers row ``r`` to rank ``r``, which sums them.
Full-precision parameters travel raw, matching plain FSDP exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from commpress.comm import checkpoint
from commpress.comm.counters import Traffic
from commpress.comm.pickling import BoundToProcess
from commpress.comm.torch_backend import allgather_object
from commpress.config.tables import FULL_PRECISION, FSDPConfig
from commpress.fsdp.collectives import quantized_all_gather, quantized_reduce_scatter
from commpress.fsdp.wire import Segments, Wire
from commpress.kernels import derive_seed
from commpress.torch_compat import (
    FSDPAllGather,
    FSDPDefaultAlloc,
    FSDPReduceScatter,
    all_gather_single,
    fsdp_param_groups,
    reduce_scatter_single,
)

__all__ = ["FSDP2State", "ParamShard", "QuantizedAllGather", "QuantizedReduceScatter", "Unit", "apply_fsdp2"]

_WEIGHTS = 1
_GRADS = 2
_OPS = (dist.ReduceOp.AVG, dist.ReduceOp.SUM)


@dataclass(frozen=True)
class ParamShard:
    """One parameter's place in the unit's flat shard (FSDP pads every shard to equal size)."""

    name: str
    numel: int  # elements of the whole (unsharded) parameter
    shard_numel: int  # elements of one rank's padded shard


@dataclass
class Unit:
    """The per-unit state both custom collectives share; ``steps`` counts its reduce-scatters."""

    index: int
    params: tuple[ParamShard, ...]
    config: FSDPConfig
    gather_traffic: Traffic = field(default_factory=Traffic)
    scatter_traffic: Traffic = field(default_factory=Traffic)
    steps: int = 0
    _wires: dict[tuple[str, int, torch.dtype], Wire | None] = field(default_factory=dict)

    @property
    def shard_numel(self) -> int:
        return sum(p.shard_numel for p in self.params)

    def segments(self, bits: int) -> Segments:
        """The quantized ranges of the flat shard at ``bits`` (none at full precision)."""
        ranges, offset = [], 0
        for p in self.params:
            if bits != FULL_PRECISION and not self.config.keeps_full_precision(p.name, p.numel):
                if ranges and ranges[-1][0] + ranges[-1][1] == offset:
                    ranges[-1] = (ranges[-1][0], ranges[-1][1] + p.shard_numel)
                else:
                    ranges.append((offset, p.shard_numel))
            offset += p.shard_numel
        return Segments(offset, tuple(ranges))

    def weight_seed(self, rank: int) -> int:
        """The seed of ``rank``'s weights in the next all-gather: keyed by the reduce-scatter count,
        so the backward re-gather of unchanged weights reproduces the forward's exactly."""
        return derive_seed(self.config.seed, _WEIGHTS, self.index, self.steps, rank)

    def grad_seed(self, step: int, rank: int, dest: int) -> int:
        """The seed of the gradient rows ``rank`` sends to ``dest`` in reduce-scatter ``step``."""
        return derive_seed(self.config.seed, _GRADS, self.index, step, rank, dest)

    def wire(self, side: str, n: int, dtype: torch.dtype) -> Wire | None:
        """The payload of ``side`` ("weights" or "grads") for ``n`` elements; None (uncompressed)
        when nothing is quantized or ``n`` is not the full shard (some parameters got no gradient)."""
        key = (side, n, dtype)
        if key not in self._wires:
            bits = self.config.weight_bits if side == "weights" else self.config.grad_bits
            segments = self.segments(bits)
            usable = n == self.shard_numel and segments.nq > 0
            self._wires[key] = (
                Wire(segments, bits, self.config.bucket_size, dtype, carry_raw=side == "weights") if usable else None
            )
        return self._wires[key]


class _UnitCollective(FSDPDefaultAlloc):
    def __init__(self, unit: Unit) -> None:
        self.unit = unit


class QuantizedAllGather(_UnitCollective, FSDPAllGather):
    """``fsdp_module.set_custom_all_gather(QuantizedAllGather(unit))``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        unit = self.unit
        n = input_tensor.numel()
        wire = unit.wire("weights", n, input_tensor.dtype)
        traffic = unit.gather_traffic
        if wire is None:
            traffic.add(nbytes=n * input_tensor.element_size(), collectives=1)
            return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        # the rank in the shard group: HSDP replicas (same master shard) gather the same weights
        quantized_all_gather(wire, input_tensor, output_tensor, group, unit.weight_seed(group.rank()), traffic)
        return None


class QuantizedReduceScatter(_UnitCollective, FSDPReduceScatter):
    """``fsdp_module.set_custom_reduce_scatter(QuantizedReduceScatter(unit))``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        unit = self.unit
        step, unit.steps = unit.steps, unit.steps + 1
        world = group.size()
        n = output_tensor.numel()
        wire = unit.wire("grads", n, input_tensor.dtype)
        traffic = unit.scatter_traffic
        if wire is None:
            traffic.add(nbytes=input_tensor.numel() * input_tensor.element_size(), collectives=1)
            return reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
        if op not in _OPS:
            raise ValueError(
                f"commpress's quantized reduce-scatter supports ReduceOp.AVG and SUM, FSDP asked for {op}: "
                "do not combine grad_bits < 32 with set_gradient_divide_factor (or set grad_bits = 32)"
            )
        # the global rank: under HSDP the replicas' rounding noise must be independent too
        seeds = [unit.grad_seed(step, dist.get_rank(), dest) for dest in range(world)]
        quantized_reduce_scatter(wire, input_tensor.view(world, n), output_tensor, group, seeds, op, traffic)
        return None


class FSDP2State(BoundToProcess):
    """What :func:`apply_fsdp2` installed, one :class:`Unit` per sharded module; checkpoint it so a
    resumed run draws the same random numbers."""

    def __init__(self, config: FSDPConfig, units: list[Unit]) -> None:
        self.config = config
        self.units = units

    def traffic(self) -> dict[str, dict[str, float]]:
        """This rank's :class:`Traffic` counts per side (``"all_gather"``, ``"reduce_scatter"``)."""
        out = {}
        for side, attr in (("all_gather", "gather_traffic"), ("reduce_scatter", "scatter_traffic")):
            snaps = [getattr(u, attr).snapshot() for u in self.units]
            out[side] = {k: sum(s[k] for s in snaps) for k in ("bytes_sent", "collectives", "compute_seconds")}
        return out

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """The units' step counters as a checkpoint part (``full=True``: the whole job, a collective)."""
        steps = [u.steps for u in self.units]
        part = checkpoint.tag({"steps": steps}, dist.get_rank(), dist.get_world_size(), max(steps, default=0), self._config())
        return checkpoint.gather_job(allgather_object, part) if full else part

    def _config(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        what = "FSDP2State.load_state_dict"
        part = checkpoint.same_everywhere(state, dist.get_rank(), dist.get_world_size(), what, self._config())
        steps = list(part["steps"])
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
    """Quantize the collectives of ``module`` (with ``recurse``, of every ``fully_shard``-ed module
    in it); ``config.exclude`` names are relative to ``root`` (default: ``module``)."""
    names = {id(p): n for n, p in (root if root is not None else module).named_parameters()}
    units: list[Unit] = []
    for where, fsdp_module in _fsdp_modules(module, recurse):
        groups = fsdp_param_groups(fsdp_module._get_fsdp_state())
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
