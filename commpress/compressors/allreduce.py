"""Baselines that all-reduce the whole bucket: ``none`` (full precision) and the casts ``fp16`` /
``bf16``. They accept float64 gradients too: every backend all-reduces float64."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from commpress.compressors.base import AllReduce, Bucket, Compressor, Context, ParamSlot, Reduction, Transfer
from commpress.compressors.registry import EXACT, register_compressor
from commpress.compressors.tensor_stats import TensorStats

__all__ = ["BF16Compressor", "FP16Compressor", "NoneCompressor"]


@register_compressor
class NoneCompressor(Compressor):
    """Plain averaging all-reduce: divide, then sum, exactly like DDP without a hook (bit-identical)."""

    name: ClassVar[str] = EXACT
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (*Compressor.dtypes, torch.float64)

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        self.check_dtype(bucket)
        if bucket.buffer.numel() == 0:
            return
        bucket.buffer.div_(ctx.world_size)
        summed = yield AllReduce(bucket.buffer)
        if summed is not bucket.buffer:
            bucket.buffer.copy_(summed)

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...]:
        """Every element in the gradients' own dtype, in one all-reduce."""
        return (Transfer("all_reduce", slot.numel * element_size),)

    def error_model(self, tensor: TensorStats) -> Callable[[], float]:
        """Exact: nothing lost."""
        return lambda: 0.0


class _CastCompressor(Compressor):
    """All-reduce in a narrower floating dtype, averaging before the cast to avoid overflow."""

    wire_dtype: ClassVar[torch.dtype]
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (*Compressor.dtypes, torch.float64)

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        self.check_dtype(bucket)
        if bucket.buffer.numel() == 0:
            return
        wire = bucket.buffer.div(ctx.world_size).to(self.wire_dtype)
        summed = yield AllReduce(wire)
        bucket.buffer.copy_(summed)

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...]:
        """Every element in the wire dtype, in one all-reduce."""
        return (Transfer("all_reduce", slot.numel * self.wire_dtype.itemsize),)

    def error_model(self, tensor: TensorStats) -> Callable[[], float]:
        """The rounding error of the cast (the difference is exact in float32)."""

        def error() -> float:
            wire = tensor.rows.to(self.wire_dtype).float()
            return tensor.factor * float((tensor.rows - wire).square().sum(dtype=torch.float64))

        return error


@register_compressor
class FP16Compressor(_CastCompressor):
    """IEEE half precision on the wire: 2 bytes per element."""

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


@register_compressor
class BF16Compressor(_CastCompressor):
    """bfloat16 on the wire: 2 bytes per element, fp32's exponent range (works on gloo)."""

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
