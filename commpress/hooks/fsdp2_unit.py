"""One FSDP2 unit (a ``fully_shard``-ed module's parameter group) as the hooks see it:
the layout of its flat shard, which parameters stay in full precision, and its step counter."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from commpress.comm.traffic import Traffic
from commpress.hooks.fsdp_config import FULL_PRECISION, FSDPConfig
from commpress.hooks.fsdp_wire import Segments, Wire

__all__ = ["ParamShard", "Unit"]


@dataclass(frozen=True)
class ParamShard:
    """One parameter's place in the unit's flat shard (FSDP pads every shard to equal size)."""

    name: str
    numel: int  # elements of the whole (unsharded) parameter
    shard_numel: int  # elements of one rank's padded shard


@dataclass
class Unit:
    """The per-unit state both custom collectives share.

    ``steps`` counts the unit's reduce-scatters: weights are gathered with a seed derived
    from it, so the backward re-gather reproduces the forward's quantized weights exactly
    (the master shard only changes after a reduce-scatter and optimizer step).
    """

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

    def wire(self, side: str, n: int, dtype: torch.dtype) -> Wire | None:
        """The payload format of ``side`` ("weights" or "grads") for a flat shard of ``n``
        elements; None when nothing is quantized or ``n`` is not this unit's full shard
        (some parameters got no gradient, or a resharded-after-forward copy): those
        collectives run uncompressed."""
        key = (side, n, dtype)
        if key not in self._wires:
            bits = self.config.weight_bits if side == "weights" else self.config.grad_bits
            segments = self.segments(bits)
            usable = n == self.shard_numel and segments.nq > 0
            # weights carry raw ranges in the payload; gradients reduce them separately
            self._wires[key] = (
                Wire(segments, bits, self.config.bucket_size, dtype, carry_raw=side == "weights") if usable else None
            )
        return self._wires[key]
