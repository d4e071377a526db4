"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r approximation by one step of subspace
iteration per training step, warm-started, with error feedback. Two all-reduces per
bucket: all P factors (plus the uncompressed elements) in one, all Q factors in the other.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from commpress.compressors.base import AllReduce, Bucket, Context, Reduction
from commpress.compressors.lowrank import LowRankCompressor
from commpress.compressors.lowrank_plan import orthonormalize
from commpress.compressors.registry import register_compressor

__all__ = ["PowerSGDCompressor"]


@register_compressor
class PowerSGDCompressor(LowRankCompressor):
    """Per matrix ``M = grad + error``: ``P = M Q``; all-reduce P; orthonormalize P;
    ``Q = M^T P``; all-reduce Q; result ``P Q^T / world``; error ``M - P Q^T / world``.

    Sends ``4 r (n + m)`` bytes per n x m matrix per step, plus the dense elements in fp32.
    """

    name: ClassVar[str] = "powersgd"
    rounds: ClassVar[int] = 2

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        begun = self._begin(bucket)
        if begun is None:
            return
        st, ms = begun
        plan = st.plan
        first = self._payload(bucket, st, plan.p_numel, ctx.world_size)
        for m, q, p in zip(ms, self._start_qs(bucket, st), plan.p_views(first)):
            torch.bmm(m, q, out=p)
        summed = yield AllReduce(first)
        self._write_dense(summed, bucket, st, plan.p_numel)
        if not self._usable(summed, bucket, st) or not plan.batches:
            return
        ps = [orthonormalize(p) for p in plan.p_views(summed)]
        second = torch.empty(plan.q_numel, dtype=torch.float32)
        for m, p, qt in zip(ms, ps, plan.qt_views(second)):
            torch.bmm(p.transpose(1, 2), m, out=qt)
        summed = yield AllReduce(second)
        if not self._usable(summed, bucket, st):
            return
        summed.div_(ctx.world_size)
        self._decompress(bucket, st, ms, ps, plan.qt_views(summed))
        st.q = summed
