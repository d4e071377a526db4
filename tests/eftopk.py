"""A test-only Top-k with error feedback: keeps the ``ratio`` largest entries of
grad + residual, all-reduces them densely and keeps the rest as residual. Its only job is
to have a ratio knob and error-feedback state, so that plan changes can be checked to
keep that state (mass is conserved: sent + residual == input + old residual, exactly).
The traffic model prices it as if it sent only the kept entries (a stand-in for a sparse
encoding), so the planner sets its ratio from the links."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import torch

from commpress.compressors import AllReduce, Bucket, Compressor, Context, ParamSlot, Reduction, Transfer, register_compressor
from commpress.schema import Bounds


@register_compressor
class EFTopK(Compressor):
    name: ClassVar[str] = "test-eftopk"

    def __init__(self, ratio: Annotated[float, Bounds(gt=0, le=1)] = 0.1) -> None:
        self.ratio = ratio
        self.residuals: dict[int, torch.Tensor] = {}

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        self.check_dtype(bucket)
        old = self.residuals.get(bucket.index)
        if old is None or old.shape != bucket.buffer.shape:  # new bucket, or DDP rebuilt its buckets
            old = torch.zeros_like(bucket.buffer)
        acc = bucket.buffer + old
        k = max(1, math.ceil(self.ratio * acc.numel()))
        keep = torch.zeros_like(acc)
        idx = acc.abs().topk(k, sorted=False).indices
        keep[idx] = acc[idx]
        self.residuals[bucket.index] = acc - keep
        summed = yield AllReduce(keep)
        bucket.buffer.copy_(summed / ctx.world_size)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {i: r.clone() for i, r in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {i: r.clone() for i, r in state.get("residuals", {}).items()}

    def params_for_ratio(self, ratio: float, slots: Sequence[ParamSlot]) -> dict[str, Any]:
        return {"ratio": ratio}

    def transfers(self, slots: Sequence[ParamSlot], element_size: int = 4) -> tuple[Transfer, ...]:
        """Priced per bucket (k of the whole bucket), not per tensor: overrides the sum."""
        numel = sum(s.numel for s in slots)
        return (Transfer("all_reduce", 4 * max(1, math.ceil(self.ratio * numel))),)
