"""TernGrad (Wen et al., 2017): every gradient element becomes -s, 0 or +s, 2 bits on the wire.

Per tensor: clip at ``clip_sigma`` standard deviations (about zero), take s = max|g| (one scalar per
tensor, shared across ranks by a max all-reduce: ONE small collective per bucket),
keep each element with probability |g|/s (so the expectation is g: unbiased), and send
the signs packed 4 per byte, all tensors of a bucket in ONE all-gather. The
scales are not gathered again: after the max all-reduce every rank already holds them.

Wire bytes per rank and bucket: sum over tensors of ceil(n/4) + 4 bytes per tensor.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from commpress.compressors import host
from commpress.compressors.base import AllGather, AllReduce, Bucket, Compressor, Context, Reduction, on_dense_copy
from commpress.compressors.framing import unframe
from commpress.compressors.registry import register_compressor
from commpress.compressors.seeding import check_seed, tensor_seeds
from commpress.cuda import span_stats, ternary_quantize_pack_many, ternary_unpack_accumulate_many
from commpress.errors import ConfigError

__all__ = ["TernGradCompressor"]


@register_compressor
class TernGradCompressor(Compressor):
    """Stochastic ternary gradients with layer-wise scales shared across ranks.

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

    Non-finite gradients: a tensor holding Inf/NaN on any rank comes out as NaN on every
    rank (its shared scale becomes +Inf), so ``torch.amp.GradScaler`` skips the step
    everywhere. TernGrad keeps no state that such a step could corrupt.
    """

    name: ClassVar[str] = "terngrad"
    rounds: ClassVar[int] = 2

    def __init__(self, clip_sigma: float = 2.5, seed: int = 0, skip_last_layer: bool = False) -> None:
        if not (math.isfinite(clip_sigma) and clip_sigma >= 0):
            raise ConfigError(
                f"method 'terngrad': clip_sigma = {clip_sigma!r} is not accepted; expected a finite number >= 0 (0 = no clipping)"
            )
        check_seed("method 'terngrad'", seed)
        if not isinstance(skip_last_layer, bool):
            raise ConfigError(f"method 'terngrad': skip_last_layer = {skip_last_layer!r} is not accepted; expected true or false")
        self.clip_sigma = clip_sigma
        self.seed = seed
        self.skip_last_layer = skip_last_layer

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        self.check_dtype(bucket)
        if not bucket.buffer.is_contiguous():  # a strided view: work on a dense copy
            yield from on_dense_copy(self.reduce, bucket, ctx)
            return
        slots = [s for s in bucket.slots if s.numel]
        if not slots:
            return
        spans = [(s.offset, s.numel) for s in slots]
        bounds, peaks, scales = self._local_scales(bucket.buffer, spans)
        shared = yield AllReduce(scales, op="max")
        # Elements above the shared scale are always kept (probability >= 1): the quantizer
        # clips at s by itself. Clip (inside the quantizer's pass) only where this rank's
        # bound is lower. A tensor whose shared scale is +Inf (Inf/NaN on some rank) gets
        # zero codes, and NaN after the decode.
        clip = torch.where(bounds < torch.minimum(peaks, shared), bounds, math.inf)
        seeds = tensor_seeds(self.seed, ctx.rank, ctx.step, bucket, slots)
        gathered = yield AllGather(ternary_quantize_pack_many(bucket.buffer, spans, shared, seeds, clip))
        (packed,) = unframe(gathered, [(torch.uint8, sum(_packed_len(s.numel) for s in slots))])
        ternary_unpack_accumulate_many(packed, shared.expand(ctx.world_size, -1), spans, bucket.buffer)
        # one host transfer: each scale finite, and all small enough that no rank sum overflows
        *finite, bounded = host.flags(torch.cat([torch.isfinite(shared), host.finite(shared, bound=_sum_bound(ctx)).view(1)]))
        for (offset, numel), ok in zip(spans, finite):
            if not ok:
                bucket.buffer.narrow(0, offset, numel).fill_(math.nan)
        # decoded values are sums of world codes times a scale of at most max|g| (which the
        # bucket's dtype holds), averaged: finite exactly when the scales are, if bounded
        bucket.finite = False if not all(finite) else (True if bounded else None)

    def _local_scales(
        self, buffer: torch.Tensor, spans: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per tensor (``spans`` of ``buffer``) on this rank, float32[T] each: the clip bound,
        max|g|, and the scale.

        The bound is ``clip_sigma`` times the root mean square of the tensor (+Inf when
        clipping is off or the tensor is 0); the scale is max|g| after clipping, +Inf for a
        tensor that holds Inf or NaN. One pass over the bucket (:func:`commpress.cuda.span_stats`):
        a bucket holds many small tensors, and a pass per tensor and statistic costs more.
        """
        peak, sumsq = span_stats(buffer, spans)  # one pass: max|g| (NaN if the tensor holds one), sum of g^2
        if self.clip_sigma:
            numel = torch.tensor([n for _, n in spans], dtype=torch.float64, device=sumsq.device)
            bound = (self.clip_sigma * (sumsq / numel).sqrt()).float()
            bound = torch.where(bound > 0, bound, math.inf)  # 0, or NaN from a non-finite tensor: no clipping
        else:
            bound = torch.full_like(peak, math.inf)
        scale = torch.minimum(peak, bound)
        scale = torch.where(torch.isfinite(scale) & torch.isfinite(peak), scale, math.inf)
        return bound, peak, scale


def _sum_bound(ctx: Context) -> float:
    """The largest scale whose sum over the world's ranks stays finite in float32."""
    return torch.finfo(torch.float32).max / ctx.world_size


def _packed_len(n: int) -> int:
    return (n + 3) // 4
