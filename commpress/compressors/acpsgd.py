"""ACP-SGD (Zhang et al., ICDCS 2023): PowerSGD's two factor updates, one per step.

Even steps all-reduce ``P = M Q``, odd steps ``Q = M^T P``: one all-reduce per bucket and step,
so DDP's bucketing and overlap are kept; the alternation is the warm start.

Which factor a step sends follows the step number alone, never the state, so every rank issues
the same all-reduce even when a healing replica (torchft) starts empty; a missing factor is the
step's shared random draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from commpress.compressors.base import AllReduce, Bucket, Context, ParamSlot, Reduction, Transfer
from commpress.compressors.lowrank import LowRankCompressor, _Layout, _Step
from commpress.compressors.lowrank_plan import orthonormalize
from commpress.compressors.registry import register_compressor
from commpress.compressors.wire.seeding import shared_normal, stream_starts

__all__ = ["ACPSGDCompressor"]


@register_compressor
class ACPSGDCompressor(LowRankCompressor):
    """Alternating low-rank compression with error feedback; without ``warm_start`` every step is
    a P step from a fresh shared random Q."""

    name: ClassVar[str] = "acpsgd"

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...]:
        """The mean of the P and Q factors per step (P without ``warm_start``), plus the dense elements."""
        factors = self.factor_numels(slot)
        if factors is None:
            return (Transfer("all_reduce", 4.0 * slot.numel),)
        return (Transfer("all_reduce", 4.0 * (sum(factors) / 2 if self.warm_start else factors[0])),)

    def params_for_ratio(self, ratio: float, slots: Sequence[ParamSlot]) -> dict[str, Any]:
        """P or Q per step: about twice PowerSGD's rank (P only without ``warm_start``)."""
        return self._rank_for_ratio(ratio, slots, lambda n, m: (n + m) / 2 if self.warm_start else n)

    def _rounds(self, bucket: Bucket, ctx: Context, step: _Step) -> Reduction:
        lay = step.layout
        plan = lay.plan
        old_p = None
        if self.warm_start and ctx.step % 2 == 1 and plan.batches:
            old_p, _ = self._memory.gather("p", lay.ps, plan.p_numel, lay.device, fill=lambda: self._random_p(lay, ctx.step))
        if old_p is None:
            qs = self._start_qs(lay, ctx.step) if plan.batches else []
            payload = self._payload(bucket, plan, plan.p_numel, ctx.world_size)
            for m, q, p in zip(step.ms, qs, plan.p_views(payload)):
                torch.bmm(m, q, out=p)
            factor_numel = plan.p_numel
        else:
            ps = [orthonormalize(p) for p in plan.p_views(old_p)]
            payload = self._payload(bucket, plan, plan.q_numel, ctx.world_size)
            for m, p, qt in zip(step.ms, ps, plan.qt_views(payload)):
                torch.bmm(p.transpose(1, 2), m, out=qt)
            factor_numel = plan.q_numel
        summed = yield AllReduce(payload)
        self._write_dense(summed, bucket, plan, factor_numel)
        if not plan.batches or not self._usable(summed, bucket, plan):
            return
        factors = summed.narrow(0, 0, factor_numel).div_(ctx.world_size)
        if old_p is None:
            self._decompress(bucket, step, plan.p_views(factors), [q.transpose(1, 2) for q in qs])
            self._memory.stage("p", lay.ps, summed)
        else:
            self._decompress(bucket, step, ps, plan.qt_views(factors))
            self._memory.stage("q", lay.qs, summed)
        return True  # the factors and the dense elements were checked: their products are finite

    def _random_p(self, lay: _Layout, step: int) -> torch.Tensor:
        """Shared random P factors for a Q step where a matrix holds none, from streams of their own."""
        pieces = [(f"{name}/p", f.n * f.rank) for name, f in zip(lay.names, lay.plan.factors)]
        return shared_normal(stream_starts(self.seed, pieces, lay.device), step)
