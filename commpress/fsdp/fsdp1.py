"""Comm hooks for FSDP1 (``FullyShardedDataParallel.register_comm_hook``).

- :func:`quantized_hook`: b-bit stochastically quantized gradients (a reduce-scatter, or an
  all-reduce for ``NO_SHARD``).
- :func:`low_precision_hook`: fp16/bf16 gradients, unlike ``fp16_compress_hook`` also on CPU.

A hook gets one flat gradient per unit, mixing its parameters, so ``exclude`` does not apply;
small units and ``grad_bits = 32`` use PyTorch's default hooks. ``weight_bits`` is FSDP2-only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from commpress.comm import checkpoint
from commpress.comm.counters import Traffic
from commpress.comm.pickling import check_default_group
from commpress.comm.torch_backend import allgather_object, require_initialized
from commpress.config.tables import FULL_PRECISION, FSDPConfig
from commpress.fsdp.collectives import quantized_all_reduce, quantized_reduce_scatter
from commpress.fsdp.wire import Segments, Wire
from commpress.kernels import derive_seed

__all__ = ["LowPrecisionState", "QuantizedState", "low_precision_hook", "quantized_hook", "register_fsdp1"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _LazyState(default_hooks.DefaultState):
    """PyTorch's FSDP hook state, connecting to its group at the first hook, so it may be built
    before ``init_process_group`` and pickled (:mod:`commpress.comm.pickling`)."""

    __slots__ = ["_connected", "_group"]

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self._group = process_group
        self._connected = False

    def connect(self) -> None:
        """Resolve the process group (idempotent)."""
        if not self._connected:
            require_initialized(f"the FSDP1 hook state ({type(self).__name__})")
            default_hooks.DefaultState.__init__(self, self._group if self._group is not None else dist.group.WORLD)
            self._connected = True

    def _pickled(self, **fields: Any) -> dict[str, Any]:
        check_default_group(self._group, f"the FSDP1 hook state ({type(self).__name__})")
        return fields


class QuantizedState(_LazyState):
    """State of :func:`quantized_hook`; its call counter seeds stochastic rounding (hooks run in
    the same order on every rank)."""

    __slots__ = ["_wires", "config", "steps", "traffic"]

    def __init__(self, config: FSDPConfig, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(process_group)
        self.config = config
        self.traffic = Traffic()
        self.steps = 0
        self._wires: dict[tuple[int, torch.dtype], Wire] = {}

    def __getstate__(self) -> dict[str, Any]:
        return self._pickled(config=self.config, steps=self.steps, traffic=self.traffic)

    def __setstate__(self, state: dict[str, Any]) -> None:
        QuantizedState.__init__(self, state["config"])
        self.steps, self.traffic = state["steps"], state["traffic"]

    def wire(self, n: int, dtype: torch.dtype) -> Wire | None:
        """The payload format for flat gradients of ``n`` elements; None: full precision."""
        if self.config.grad_bits == FULL_PRECISION or n < self.config.min_numel:
            return None
        key = (n, dtype)
        if key not in self._wires:
            self._wires[key] = Wire(Segments(n, ((0, n),)), self.config.grad_bits, self.config.bucket_size, dtype)
        return self._wires[key]

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """The call counter as a checkpoint part (``full=True``: the whole job, a collective)."""
        if full:
            self.connect()
        group = self.process_group if self._connected else None
        where = (dist.get_rank(group), dist.get_world_size(group)) if self._connected else (None, None)
        part = checkpoint.tag({"steps": self.steps}, *where, self.steps, dataclasses.asdict(self.config))
        return checkpoint.gather_job(functools.partial(allgather_object, group=group), part) if full else part

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.connect()
        rank, world = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        what = "QuantizedState.load_state_dict"
        self.steps = int(checkpoint.same_everywhere(state, rank, world, what, dataclasses.asdict(self.config))["steps"])


def quantized_hook(state: QuantizedState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Average ``grad`` over ranks, b-bit quantized, into ``output`` (in place for ``NO_SHARD``)."""
    state.connect()
    step, state.steps = state.steps, state.steps + 1
    group, world = state.process_group, state.world_size
    rank = dist.get_rank(group)
    wire = state.wire(output.numel() if output is not None else grad.numel(), grad.dtype)
    if wire is None:
        state.traffic.add(nbytes=grad.numel() * grad.element_size(), collectives=1)
        if output is None:
            default_hooks.allreduce_hook(state, grad)
        else:
            default_hooks.reduce_scatter_hook(state, grad, output)
        return
    seed = state.config.seed
    if output is None:
        quantized_all_reduce(wire, grad, group, derive_seed(seed, step, rank), state.traffic)
        return
    seeds = [derive_seed(seed, step, rank, dest) for dest in range(world)]
    quantized_reduce_scatter(wire, grad.view(world, -1), output, group, seeds, dist.ReduceOp.AVG, state.traffic)


class LowPrecisionState(_LazyState):
    """State of :func:`low_precision_hook`: the wire dtype (fp16 or bf16)."""

    __slots__ = ["dtype", "traffic"]

    def __init__(self, dtype: torch.dtype = torch.float16, process_group: dist.ProcessGroup | None = None) -> None:
        if dtype not in _LOW_PRECISION:
            raise TypeError(f"dtype = {dtype} is not accepted; accepted: torch.float16, torch.bfloat16")
        super().__init__(process_group)
        self.dtype = dtype
        self.traffic = Traffic()

    def __getstate__(self) -> dict[str, Any]:
        return self._pickled(dtype=self.dtype, traffic=self.traffic)

    def __setstate__(self, state: dict[str, Any]) -> None:
        LowPrecisionState.__init__(self, state["dtype"])
        self.traffic = state["traffic"]


def low_precision_hook(state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Average ``grad`` over ranks in ``state.dtype``, cast back into ``output`` (or ``grad``)."""
    state.connect()
    low = grad.to(state.dtype)
    state.traffic.add(nbytes=low.numel() * low.element_size(), collectives=1)
    if output is None:
        default_hooks.allreduce_hook(state, low)
        grad.copy_(low)
    else:
        low_out = low.new_empty(output.shape)
        default_hooks.reduce_scatter_hook(state, low, low_out)
        output.copy_(low_out)


def register_fsdp1(model: FullyShardedDataParallel, config: FSDPConfig) -> QuantizedState:
    """Register :func:`quantized_hook` on the root FSDP1 instance ``model``."""
    if not isinstance(model, FullyShardedDataParallel):
        raise TypeError(f"expected a FullyShardedDataParallel model, got {type(model).__name__}")
    if not model.check_is_root():
        raise ValueError(
            "FSDP1 comm hooks can only be registered on the root FullyShardedDataParallel instance (they apply to "
            "every unit inside it): call commpress.fsdp.apply on the outermost FSDP module"
        )
    strategies = {m.sharding_strategy for m in FullyShardedDataParallel.fsdp_modules(model)}
    if strategies & set(_HYBRID):
        raise ValueError(
            f"FSDP1 does not accept comm hooks with hybrid sharding ({', '.join(sorted(s.name for s in strategies))}); "
            "use FSDP2 (fully_shard with a 2-D device mesh) for quantized HSDP"
        )
    state = QuantizedState(config, model.process_group)
    model.register_comm_hook(state, quantized_hook)
    return state
