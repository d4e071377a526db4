"""TernGrad (Wen et al., 2017): every gradient element becomes -s, 0 or +s, 2 bits on the wire.

Per tensor and rank: clip, take s = max|g|, keep each element with probability |g|/s (unbiased
for the clipped g), and pack the signs 4 per byte. All ranks' scales and codes travel in ONE
all-gather, each rank's codes decoded with its own scales. TernGrad's scaler sharing (a max
all-reduce first) only lets a parameter server sum codes as integers; a float decode needs no
shared scale, so that extra round is left out.

Wire bytes per rank and bucket: Σ_t ceil(n/4) + 4 (with ``entropy``, Huffman-coded).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar

import torch

from commpress.compressors import host
from commpress.compressors.base import (
    AllGather,
    Bucket,
    Compressor,
    Context,
    ParamSlot,
    Reduction,
    Setting,
    Transfer,
    over_tensors,
)
from commpress.compressors.ladder import pool
from commpress.compressors.registry import register_compressor
from commpress.compressors.tensor_stats import TensorStats
from commpress.compressors.wire.entropy import coded_gather
from commpress.compressors.wire.framing import frame, unframe
from commpress.compressors.wire.seeding import Seed, tensor_seeds
from commpress.compressors.wire.spans import SpanTensors
from commpress.kernels import packed_size, span_stats, ternary_quantize_pack_many, ternary_unpack_accumulate_many
from commpress.schema import Bounds

__all__ = ["TernGradCompressor"]


@register_compressor
class TernGradCompressor(Compressor):
    """Stochastic ternary gradients with a scale per tensor and rank, in one all-gather.

    Args:
        clip_sigma: clip each tensor at ``clip_sigma`` times sqrt(mean(g^2)) (TernGrad's
            clipping). That is sigma for the zero-mean gradients TernGrad assumes, and unlike
            the deviation about the mean it never clips a nearly constant tensor away.
        skip_last_layer: average exactly, as TernGrad's reference does for the classifier, the
            last module in ``model.named_modules()`` holding parameters
            (:class:`commpress.config.groups.MethodGroups`); another head needs an override.
        entropy: Huffman-code the codes (:mod:`commpress.compressors.wire.entropy`): lossless,
            at CPU cost and a second 8-byte collective, so worth it where the link sets the step
            time (docs/local_sgd.md).

    A tensor holding Inf/NaN on any rank gets scale +Inf there, so it decodes to NaN everywhere.
    """

    name: ClassVar[str] = "terngrad"

    def __init__(
        self,
        clip_sigma: Annotated[float, Bounds(ge=0, note="0 = no clipping")] = 2.5,
        seed: Seed = 0,
        skip_last_layer: bool = False,
        entropy: bool = False,
    ) -> None:
        self.clip_sigma = clip_sigma
        self.seed = seed
        self.skip_last_layer = skip_last_layer
        self.entropy = entropy
        self.rounds = 2 if entropy else 1  # type: ignore[misc]  # the coded sizes' maximum, then the gather
        self._spans = SpanTensors()

    @over_tensors
    def reduce(self, bucket: Bucket, ctx: Context, slots: list[ParamSlot]) -> Reduction:
        spans = [(s.offset, s.numel) for s in slots]
        scales = self._local_scales(bucket.buffer, spans)
        seeds = tensor_seeds(self.seed, ctx.rank, ctx.step, bucket, slots)
        # elements above s are always kept, so the quantizer clips by itself; scale +Inf gets zero codes
        packed = ternary_quantize_pack_many(bucket.buffer, spans, scales, seeds)
        payload = frame([scales, packed])
        if self.entropy:
            gathered = yield from coded_gather(payload)
        else:
            gathered = yield AllGather(payload)
        all_scales, all_packed = unframe(gathered, [(torch.float32, len(slots)), (torch.uint8, packed.numel())])
        ternary_unpack_accumulate_many(all_packed, all_scales, spans, bucket.buffer)
        finite_all = torch.isfinite(all_scales).all(0)
        if host.reads_stall(bucket.buffer):  # no read: NaN where a scale is not finite, the hook's step flag sees it
            self._spans.spoil(bucket.buffer, spans, finite_all)
            return None
        # one host transfer: every scale finite, and small enough that no sum over the ranks overflows float32
        limit = torch.finfo(torch.float32).max / ctx.world_size
        *finite, bounded = host.flags(torch.cat([finite_all, host.finite(all_scales, bound=limit).view(1)]))
        if not all(finite):
            self._spans.spoil(bucket.buffer, spans, finite_all)
        # decoded values are averages of codes times scales of at most max|g|: finite if the scales are
        return False if not all(finite) else (True if bounded else None)

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...]:
        """One all-gather: a float32 scale and the 2-bit codes. Entropy-coded, an upper bound after
        the coded sizes' all-reduce."""
        codes = Transfer("all_gather", 4 + packed_size(slot.numel, 2) if slot.numel else 0)
        return (Transfer("all_reduce", 0), codes) if self.entropy else (codes,)

    def ladder(self, params: Mapping[str, Any]) -> list[Setting]:
        """No knob: the configured setting, then the pool with PowerSGD at ranks 4 and 8 only (lower
        ranks displaced TernGrad where it does well: docs/choosing.md)."""
        return [(self.name, dict(params)), *pool(self.name, params, (4, 8))]

    def error_model(self, tensor: TensorStats) -> Callable[[], float]:
        """The clipping error plus the rounding variance, ``s|c| - c^2`` per clipped element c."""

        def error() -> float:
            a = tensor.double.abs()
            scale = float(tensor.whole.abs().max())  # the tensor's scale, not the rows'
            if self.clip_sigma:
                scale = min(scale, self.clip_sigma * math.sqrt(tensor.whole_energy / tensor.numel))
            clipped = a.clamp(max=scale)
            return tensor.factor * float((a - clipped).square().sum() + (scale * clipped - clipped.square()).sum())

        return error

    def _local_scales(self, buffer: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Each tensor's scale, max|g| after clipping (+Inf where it holds Inf or NaN), in one pass over
        the bucket (:func:`commpress.kernels.span_stats`), not one per small tensor."""
        peak, sumsq = span_stats(buffer, spans)  # max|g| (NaN if the tensor holds one), sum of g^2
        scale = peak
        if self.clip_sigma:
            numel = self._spans.sizes(spans, sumsq.device)
            bound = (self.clip_sigma * (sumsq / numel).sqrt()).float()
            bound = torch.where(bound > 0, bound, math.inf)  # 0, or NaN from a non-finite tensor: no clipping
            scale = torch.minimum(peak, bound)
        return torch.where(torch.isfinite(scale) & torch.isfinite(peak), scale, math.inf)
