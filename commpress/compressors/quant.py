"""b-bit stochastic quantization with a (min, scale) per ``bucket_size`` elements (the int8 / 4-bit
wire of Streaming DiLoCo and Prime's int8 all-reduce).

Each element travels as q = floor((x - lo) / scale + u), u uniform in [0, 1), so the decode is
unbiased (:mod:`commpress.kernels.quantize`, the FSDP collectives' quantizer). Buckets never
span two tensors, so the result does not depend on DDP's bucketing. All ranks' codes, and the
tensors under ``min_numel`` sent whole, travel in ONE all-gather.

Wire bytes per rank and bucket: Σ_t ⌈n·b/8⌉ + 8·⌈n/bucket_size⌉, plus 4·d sent whole.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import torch

from commpress.compressors import host
from commpress.compressors.base import AllGather, Bucket, Compressor, Context, ParamSlot, Reduction, Transfer, over_tensors
from commpress.compressors.registry import register_compressor
from commpress.compressors.tensor_stats import TensorStats, runs
from commpress.compressors.wire.framing import frame, unframe
from commpress.compressors.wire.memory import ErrorMemory, MemoryState, Piece
from commpress.compressors.wire.seeding import Seed, tensor_key, tensor_seeds
from commpress.compressors.wire.whole import DEFAULT_MIN_NUMEL, MinNumel, average_whole, split_whole, whole_part, write_whole
from commpress.errors import ConfigError
from commpress.kernels import add_error, dequantize, packed_size, quantize_pack, unpack_accumulate, update_error

__all__ = ["DEFAULT_BUCKET_SIZE", "QuantCompressor"]

#: The bit widths, as a type (the ``bits`` parameter) and as values.
Bits = Literal[2, 4, 8]
BITS: tuple[int, ...] = typing.get_args(Bits)
#: Elements per (min, scale), as ``[fsdp] bucket_size``: small enough that one outlier widens only
#: its own bucket's steps, large enough that the ranges cost little.
DEFAULT_BUCKET_SIZE = 1024


@register_compressor
class QuantCompressor(MemoryState, Compressor):
    """Uniform b-bit stochastic quantization with a (min, scale) per bucket of elements.

    With ``error_feedback`` each rank keeps its rounding error for the next step: delayed, not
    lost, but no longer unbiased on its own. A tensor holding Inf/NaN on any rank gets a
    non-finite (min, scale), so every rank writes NaN into it and no residual is staged.
    """

    name: ClassVar[str] = "quant"
    per_rank_state: ClassVar[tuple[str, ...]] = ("residuals",)
    knob: ClassVar[str | None] = "bits"

    def __init__(
        self,
        bits: Bits = 8,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        error_feedback: bool = False,
        min_numel: MinNumel = DEFAULT_MIN_NUMEL,
        seed: Seed = 0,
    ) -> None:
        # a multiple is no range the signature can declare
        if bucket_size < 8 or bucket_size % 8:
            raise ConfigError(f"method 'quant': bucket_size = {bucket_size!r} is not accepted; expected a multiple of 8, >= 8")
        self.bits = bits
        self.bucket_size = bucket_size
        self.error_feedback = error_feedback
        self.min_numel = min_numel
        self.seed = seed
        self._memory = ErrorMemory()

    @over_tensors
    def reduce(self, bucket: Bucket, ctx: Context, slots: list[ParamSlot]) -> Reduction:
        quantized, whole = split_whole(slots, self.min_numel)
        pieces = [(tensor_key(bucket, s), s.offset, tuple(s.shape)) for s in quantized]
        x = self._accumulate(bucket.buffer, pieces)
        seeds = tensor_seeds(self.seed, ctx.rank, ctx.step, bucket, quantized)
        payloads = [
            quantize_pack(x.narrow(0, s.offset, s.numel), self.bits, self.bucket_size, seed) for s, seed in zip(quantized, seeds)
        ]
        if self.error_feedback:
            for s, (packed, mins, scales) in zip(quantized, payloads):
                acc = x.narrow(0, s.offset, s.numel)
                update_error(acc, dequantize(packed, mins, scales, self.bits, self.bucket_size, s.numel), acc)
        dense, dense_pieces = whole_part(bucket.buffer, bucket, whole)
        gathered = yield AllGather(frame([dense, *(p for packed, mins, scales in payloads for p in (mins, scales, packed))]))
        all_dense, *parts = unframe(gathered, [(torch.float32, dense.numel()), *self._layout(quantized)])
        received = [tuple(parts[3 * i : 3 * i + 3]) for i in range(len(quantized))]
        for s, (mins, scales, packed) in zip(quantized, received):
            out = bucket.buffer.narrow(0, s.offset, s.numel)
            unpack_accumulate(packed, mins, scales, self.bits, self.bucket_size, s.numel, out, average=True)
        average = average_whole(all_dense)
        write_whole(bucket.buffer, whole, dense_pieces, average)
        # one host transfer: every (min, scale) and whole tensor finite, and small enough that no sum overflows
        limit = min(torch.finfo(torch.float32).max / ctx.world_size, torch.finfo(bucket.buffer.dtype).max) / 4
        bounded = host.finite(all_dense, bound=limit)
        for mins, scales, _ in received:
            bounded = bounded & host.finite(mins, bound=limit) & host.finite(scales, bound=limit / (2**self.bits - 1))
        checks = [host.finite(mins, scales) for mins, scales, _ in received]
        *finite, whole_finite, bounded = host.flags(torch.stack([*checks, host.finite(all_dense), bounded]))
        for s, ok in zip(quantized, finite):
            if not ok:
                bucket.buffer.narrow(0, s.offset, s.numel).fill_(math.nan)
        if not (all(finite) and whole_finite):
            return False
        if self.error_feedback and pieces:  # not from a non-finite step: the old residuals stay
            self._memory.stage("residual", pieces, x)
        # a decoded value is at most |min| + (2^b - 1)·scale; unbounded sums are left to the hook's check
        return True if bounded else None

    def _accumulate(self, grad: torch.Tensor, pieces: list[Piece]) -> torch.Tensor:
        """What is quantized: the gradient, or with error feedback a fresh float32 grad + residual."""
        if not self.error_feedback or not pieces:
            return grad
        residual, _ = self._memory.gather("residual", pieces, grad.numel(), grad.device)
        return add_error(grad, residual.narrow(0, 0, grad.numel()))

    def _layout(self, slots: Sequence[ParamSlot]) -> list[tuple[torch.dtype, int]]:
        """Frame pieces per quantized tensor: mins, scales (float32, one per bucket), codes."""
        out = []
        for s in slots:
            nb = -(-s.numel // self.bucket_size)
            out += [(torch.float32, nb), (torch.float32, nb), (torch.uint8, packed_size(s.numel, self.bits))]
        return out

    def _nbytes(self, numel: int, bits: int) -> int:
        """Wire bytes of one tensor of ``numel`` elements at ``bits`` bits."""
        if numel < self.min_numel:
            return 4 * numel
        return packed_size(numel, bits) + 8 * -(-numel // self.bucket_size)

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...]:
        """One all-gather: the codes and a float32 (min, scale) per bucket."""
        return (Transfer("all_gather", self._nbytes(slot.numel, self.bits)),)

    def params_for_ratio(self, ratio: float, slots: Sequence[ParamSlot]) -> dict[str, Any]:
        """The most ``bits`` whose bytes stay within ``ratio`` of float32's (else 2)."""
        target = ratio * 4 * sum(s.numel for s in slots)
        fits = [b for b in BITS if sum(self._nbytes(s.numel, b) for s in slots) <= target]
        return {"bits": max(fits, default=BITS[0])}

    def error_model(self, tensor: TensorStats) -> Callable[[], float]:
        """The variance of stochastic rounding, ``step^2 f (1 - f)`` per element (f: its fraction of a step)."""

        def error() -> float:
            if tensor.numel < self.min_numel:
                return 0.0
            total = 0.0
            for rows in runs(tensor.double, self.bucket_size):
                lo = rows.min(1, keepdim=True).values
                step = (rows.max(1, keepdim=True).values - lo) / (2**self.bits - 1)
                f = ((rows - lo) / step.clamp(min=torch.finfo(rows.dtype).tiny)).frac()
                total += float((f * (1 - f) * step.square()).sum())
            return tensor.factor * total

        return error

    def _kinds(self) -> dict[str, str]:
        """With ``error_feedback``: ``{"residuals": {parameter name: tensor}}`` in the state; else no state."""
        return {"residuals": "residual"} if self.error_feedback else {}
