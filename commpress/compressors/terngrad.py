"""TernGrad (Wen et al., 2017): every gradient element becomes -s, 0 or +s, 2 bits on the wire.

Per tensor and rank: clip at ``clip_sigma`` standard deviations (about zero), take s = max|g|
after clipping (one scalar per tensor), keep each element with probability |g|/s (so the
expectation is the clipped g: unbiased), and send the signs packed 4 per byte. Every rank's
scales and codes of a bucket travel in ONE all-gather; each rank's codes are decoded with
its own scales. (TernGrad's scaler sharing, a max all-reduce of the scales before
quantizing, lets a parameter server sum codes as integers; decoding in float needs no shared
scale, and the extra round cost about 5% of a step on a fast link.)

Wire bytes per rank and bucket: sum over tensors of ceil(n/4) + 4 bytes per tensor; with
``entropy`` those bytes Huffman-coded (about 1.2 bits a value instead of 2 where a third of the
values are nonzero), padded to the largest rank's, plus one 8-byte all-reduce.
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
from commpress.kernels import packed_size, span_stats, ternary_quantize_pack_many, ternary_unpack_accumulate_many
from commpress.schema import Bounds

__all__ = ["TernGradCompressor"]


@register_compressor
class TernGradCompressor(Compressor):
    """Stochastic ternary gradients with a scale per tensor and rank, in one all-gather.

    Args:
        clip_sigma: clip each tensor at ``clip_sigma`` times its standard deviation about
            zero, sqrt(mean(g^2)), before quantizing (TernGrad's gradient clipping; 0 turns
            it off). For the zero-mean gradients TernGrad's analysis assumes this is its
            sigma; unlike the deviation about the mean, it never clips a tensor with a large
            common offset (a nearly constant tensor) down to a fraction of its values.
        seed: mixed with rank, step and parameter name into the key of the counter-based
            random generator, so runs are reproducible and ranks draw independent bits.
        skip_last_layer: send the model's last layer in full precision, averaged exactly
            like ``none``, as TernGrad's reference implementation leaves the classifier
            unquantized. The last layer is the weight and bias of the model's last module,
            in ``model.named_modules()`` order, that holds parameters of its own. The method
            groups apply it (:class:`commpress.config.groups.MethodGroups`: the DDP hook, the
            bandwidth layer), so they need the model; a model with another head sends it
            with an override (``params = ["head.*"]``, ``method = "none"``).
        entropy: entropy-code the codes for the wire (Huffman codes per chunk,
            :mod:`commpress.compressors.wire.entropy`): lossless, so training is the same
            bits, in about 1.2 bits a value instead of 2 when two values in three round to
            zero (TernGrad's usual share after clipping), for about 3 ms of one core per
            megabyte of codes coded and 4 per megabyte decoded, and a second, 8-byte
            collective (the coded sizes' maximum).
            Worth it where the link, not the processor, sets the step time (DiLoCo's
            overlapped syncs on slow links: docs/local_sgd.md); off by default.

    Non-finite gradients: a tensor holding Inf/NaN on any rank comes out as NaN on every
    rank (that rank's scale is +Inf, and every rank decodes it), so ``torch.amp.GradScaler`` skips the step
    everywhere. TernGrad keeps no state that such a step could corrupt.
    """

    name: ClassVar[str] = "terngrad"
    rounds: ClassVar[int] = 1

    def __init__(
        self,
        clip_sigma: Annotated[float, Bounds(ge=0, note="0 = no clipping")] = 2.5,
        seed: Seed = 0,
        skip_last_layer: bool = False,
        entropy: bool = False,
    ) -> None:
        # types and ranges: declared above, checked before this runs (registry)
        self.clip_sigma = clip_sigma
        self.seed = seed
        self.skip_last_layer = skip_last_layer
        self.entropy = entropy
        self.rounds = 2 if entropy else 1  # type: ignore[misc]  # the coded sizes' maximum, then the gather

    @over_tensors
    def reduce(self, bucket: Bucket, ctx: Context, slots: list[ParamSlot]) -> Reduction:
        spans = [(s.offset, s.numel) for s in slots]
        scales = self._local_scales(bucket.buffer, spans)
        seeds = tensor_seeds(self.seed, ctx.rank, ctx.step, bucket, slots)
        # elements above s are always kept (probability >= 1): the quantizer clips at s by
        # itself; a tensor whose scale is +Inf (Inf/NaN here) gets zero codes
        packed = ternary_quantize_pack_many(bucket.buffer, spans, scales, seeds)
        payload = frame([scales, packed])
        if self.entropy:
            gathered = yield from coded_gather(payload)
        else:
            gathered = yield AllGather(payload)
        all_scales, all_packed = unframe(gathered, [(torch.float32, len(slots)), (torch.uint8, packed.numel())])
        ternary_unpack_accumulate_many(all_packed, all_scales, spans, bucket.buffer)
        # one host transfer: each tensor's scales finite on every rank, and all small enough
        # that no sum over the ranks overflows
        finite_all = torch.isfinite(all_scales).all(0)
        *finite, bounded = host.flags(torch.cat([finite_all, host.finite(all_scales, bound=_sum_bound(ctx)).view(1)]))
        for (offset, numel), ok in zip(spans, finite):
            if not ok:
                bucket.buffer.narrow(0, offset, numel).fill_(math.nan)
        # decoded values are sums of world codes times scales of at most max|g| (which the
        # bucket's dtype holds), averaged: finite exactly when the scales are, if bounded
        return False if not all(finite) else (True if bounded else None)

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...]:
        """One all-gather: the tensor's float32 scale and its 2-bit codes (none for an empty
        tensor). Entropy-coded, a bound: the coded sizes' all-reduce (8 bytes a bucket) comes
        first, and the gather carries at most these bytes and a 4-byte length a bucket."""
        codes = Transfer("all_gather", 4 + packed_size(slot.numel, 2) if slot.numel else 0)
        return (Transfer("all_reduce", 0), codes) if self.entropy else (codes,)

    def ladder(self, params: Mapping[str, Any]) -> list[Setting]:
        """No knob: the configured setting, then the pool with PowerSGD at ranks 4 and 8
        (ranks 1 and 2 took TernGrad's place on matrices it sends well and cost it 2.8
        points on the transformer and 26 on resnet under AdamW: docs/choosing.md)."""
        return [(self.name, dict(params)), *pool(self.name, params, (4, 8))]

    def error_model(self, tensor: TensorStats) -> Callable[[], float]:
        """The clipping error plus the variance of stochastic rounding, ``s|c| - c^2`` per
        clipped element c with the tensor's scale s."""

        def error() -> float:
            a = tensor.double.abs()
            scale = float(tensor.whole.abs().max())  # the tensor's scale, not the rows'
            if self.clip_sigma:
                scale = min(scale, self.clip_sigma * math.sqrt(tensor.whole_energy / tensor.numel))
            clipped = a.clamp(max=scale)
            return tensor.factor * float((a - clipped).square().sum() + (scale * clipped - clipped.square()).sum())

        return error

    def _local_scales(self, buffer: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Per tensor (``spans`` of ``buffer``) on this rank, float32[T]: the scale, max|g|
        after clipping at ``clip_sigma`` times the tensor's root mean square; +Inf for a
        tensor that holds Inf or NaN.

        One pass over the bucket (:func:`commpress.kernels.span_stats`): a bucket holds many
        small tensors, and a pass per tensor and statistic costs more.
        """
        peak, sumsq = span_stats(buffer, spans)  # one pass: max|g| (NaN if the tensor holds one), sum of g^2
        scale = peak
        if self.clip_sigma:
            numel = torch.tensor([n for _, n in spans], dtype=torch.float64, device=sumsq.device)
            bound = (self.clip_sigma * (sumsq / numel).sqrt()).float()
            bound = torch.where(bound > 0, bound, math.inf)  # 0, or NaN from a non-finite tensor: no clipping
            scale = torch.minimum(peak, bound)
        return torch.where(torch.isfinite(scale) & torch.isfinite(peak), scale, math.inf)


def _sum_bound(ctx: Context) -> float:
    """The largest scale whose sum over the world's ranks stays finite in float32."""
    return torch.finfo(torch.float32).max / ctx.world_size
