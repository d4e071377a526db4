"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r approximation by one warm-started step of
subspace iteration per training step, with error feedback, in two all-reduces per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from commpress.compressors import host
from commpress.compressors.base import AllReduce, Bucket, Context, ParamSlot, Reduction, Transfer
from commpress.compressors.lowrank import LowRankCompressor, _Step
from commpress.compressors.lowrank_plan import orthonormalize
from commpress.compressors.registry import register_compressor

__all__ = ["PowerSGDCompressor"]


@register_compressor
class PowerSGDCompressor(LowRankCompressor):
    """Per matrix ``M = grad + error``: ``P = M Q``; all-reduce P; orthonormalize P;
    ``Q = M^T P``; all-reduce Q; result ``P Q^T / world``; error ``M - P Q^T / world``."""

    name: ClassVar[str] = "powersgd"
    rounds: ClassVar[int] = 2

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...]:
        """P factors plus the uncompressed elements (fp32) in one all-reduce, Q factors in another."""
        factors = self.factor_numels(slot)
        p, q = factors if factors is not None else (slot.numel, 0)
        return (Transfer("all_reduce", 4 * p), Transfer("all_reduce", 4 * q))

    def params_for_ratio(self, ratio: float, slots: Sequence[ParamSlot]) -> dict[str, Any]:
        """P and Q every step."""
        return self._rank_for_ratio(ratio, slots, lambda n, m: n + m)

    def _rounds(self, bucket: Bucket, ctx: Context, step: _Step) -> Reduction:
        lay = step.layout
        plan = lay.plan
        first = self._payload(bucket, plan, plan.p_numel, ctx.world_size)
        if plan.batches:
            for m, q, p in zip(step.ms, self._start_qs(lay, ctx.step), plan.p_views(first)):
                torch.bmm(m, q, out=p)
        summed = yield AllReduce(first)
        self._write_dense(summed, bucket, plan, plan.p_numel)
        if not plan.batches:
            return
        # P's finiteness is read with Q's (one host read): a non-finite P makes Q non-finite everywhere
        p_finite = host.finite(summed)
        ps = [orthonormalize(p) for p in plan.p_views(summed)]
        second = torch.empty(plan.q_numel, dtype=torch.float32, device=bucket.buffer.device)
        for m, p, qt in zip(step.ms, ps, plan.qt_views(second)):
            torch.bmm(p.transpose(1, 2), m, out=qt)
        summed = yield AllReduce(second)
        if not self._usable(summed, bucket, plan, p_finite):
            return
        summed.div_(ctx.world_size)
        self._decompress(bucket, step, ps, plan.qt_views(summed))
        self._memory.stage("q", lay.qs, summed)
        return True  # P, Q and the dense elements were checked: P Qt of finite factors is finite
