"""A custom FSDP2 reduce-scatter that sends b-bit stochastically quantized gradients.

FSDP2 hands ``__call__`` its flat reduce-scatter input: ``world`` rows, row ``r`` being the
part of every gradient that rank ``r`` owns. Each rank quantizes every row with its own
seed, an all-to-all delivers row ``r`` of every rank to rank ``r``, and rank ``r`` sums the
dequantized rows (fused unpack + accumulate), divided by ``world`` for ``ReduceOp.AVG``:
each rank receives the average of its shard. Parameters kept in full precision go through
the ordinary reduce-scatter, so they match plain FSDP exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

from commpress.cuda import derive_seed
from commpress.hooks.fsdp2_unit import Unit
from commpress.hooks.fsdp_collectives import quantized_reduce_scatter

__all__ = ["QuantizedReduceScatter"]

_GRADS = 2  # seed stream tag (weights use 1)
_OPS = (dist.ReduceOp.AVG, dist.ReduceOp.SUM)


class QuantizedReduceScatter(DefaultAllocMixin, ReduceScatter):
    """``fsdp_module.set_custom_reduce_scatter(QuantizedReduceScatter(unit))``."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

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
            return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
        if op not in _OPS:
            raise ValueError(
                f"commpress's quantized reduce-scatter supports ReduceOp.AVG and SUM, FSDP asked for {op}: "
                "do not combine grad_bits < 32 with set_gradient_divide_factor (or set grad_bits = 32)"
            )
        # the global rank: under HSDP the replicas' rounding noise must be independent too
        rank, seed = dist.get_rank(), unit.config.seed
        seeds = [derive_seed(seed, _GRADS, unit.index, step, rank, dest) for dest in range(world)]
        quantized_reduce_scatter(wire, input_tensor.view(world, n), output_tensor, group, seeds, op, traffic)
        return None
