"""ACP-SGD (Zhang et al., ICDCS 2023): PowerSGD's two factor updates, one per step.

Odd steps orthonormalize Q and all-reduce ``P = M Q``; even steps orthonormalize P and
all-reduce ``Q = M^T P``. One all-reduce per bucket and step, of about half PowerSGD's
bytes, so it keeps DDP's bucketing and overlap with the backward pass; the alternation is
the warm start, and one error buffer carries what either step left out.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from commpress.compressors.base import AllReduce, Bucket, Context, Reduction
from commpress.compressors.lowrank import LowRankCompressor
from commpress.compressors.lowrank_plan import orthonormalize
from commpress.compressors.registry import register_compressor

__all__ = ["ACPSGDCompressor"]


@register_compressor
class ACPSGDCompressor(LowRankCompressor):
    """Alternating low-rank compression with error feedback.

    Sends ``4 r n`` bytes per n x m matrix on P steps and ``4 r m`` on Q steps, plus the
    dense elements in fp32. Without ``warm_start`` every step is a P step from a fresh
    shared random Q.
    """

    name: ClassVar[str] = "acpsgd"
    rounds: ClassVar[int] = 1

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        begun = self._begin(bucket)
        if begun is None:
            return
        st, ms = begun
        plan = st.plan
        p_step = not self.warm_start or st.steps % 2 == 0 or st.p is None
        if p_step:
            qs = self._start_qs(bucket, st)
            payload = self._payload(bucket, st, plan.p_numel, ctx.world_size)
            for m, q, p in zip(ms, qs, plan.p_views(payload)):
                torch.bmm(m, q, out=p)
            factor_numel = plan.p_numel
        else:
            ps = [orthonormalize(p) for p in plan.p_views(st.p)]
            payload = self._payload(bucket, st, plan.q_numel, ctx.world_size)
            for m, p, qt in zip(ms, ps, plan.qt_views(payload)):
                torch.bmm(p.transpose(1, 2), m, out=qt)
            factor_numel = plan.q_numel
        summed = yield AllReduce(payload)
        self._write_dense(summed, bucket, st, factor_numel)
        if not self._usable(summed, bucket, st) or not plan.batches:
            return
        factors = summed[:factor_numel].div_(ctx.world_size)
        if p_step:
            self._decompress(bucket, st, ms, plan.p_views(factors), [q.transpose(1, 2) for q in qs])
            st.p = factors
        else:
            self._decompress(bucket, st, ms, ps, plan.qt_views(factors))
            st.q = factors
