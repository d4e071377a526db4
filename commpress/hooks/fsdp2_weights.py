"""A custom FSDP2 all-gather that sends b-bit stochastically quantized weights (QSDP).

FSDP2 copies each rank's flat parameter shard into its slot of the all-gather output and
hands both to ``__call__``. Each rank quantizes its shard (unbiased stochastic rounding per
bucket), the payloads are all-gathered, and every rank writes the dequantized shards of all
ranks, its own included, into the output: every rank computes with the same weights. The
master shard FSDP keeps for the optimizer is never touched, so it stays full precision.
Parameters kept in full precision travel as raw bytes inside the same payload, bit-exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

from commpress.cuda import derive_seed
from commpress.hooks.fsdp2_unit import Unit
from commpress.hooks.fsdp_collectives import quantized_all_gather

__all__ = ["QuantizedAllGather"]

_WEIGHTS = 1  # seed stream tag (gradients use 2)


class QuantizedAllGather(DefaultAllocMixin, AllGather):
    """``fsdp_module.set_custom_all_gather(QuantizedAllGather(unit))``."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit

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
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        # seeded by the unit's reduce-scatter count: the backward re-gather of unchanged
        # weights reproduces the forward's quantization exactly; by the rank in the shard
        # group: HSDP replicas (same master shard) gather the same quantized weights
        seed = derive_seed(unit.config.seed, _WEIGHTS, unit.index, unit.steps, group.rank())
        quantized_all_gather(wire, input_tensor, output_tensor, group, seed, traffic)
        return None
