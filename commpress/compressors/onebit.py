"""1-bit compression with error feedback (Seide et al., 2014; the compressor of 1-bit Adam).

Per tensor and rank: ``acc = grad + residual``; send ``sign(acc)`` (zero counts as +) and one
float32 scale, ``mean(|acc|)``; keep ``residual = acc - scale * sign(acc)``. mean(|acc|) minimises
that residual; DeepSpeed's root mean square is larger unless all magnitudes are equal.

All ranks' scales and signs travel in ONE all-gather and every rank decodes every code exactly,
so the error feedback is one-sided: the sender's residual holds the only loss (DeepSpeed's
compressed all-reduce re-compresses the average and so needs a second, server-side error).

Wire bytes per rank and bucket: Σ_t ceil(n/8) + 4, plus 4 per element sent whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch

from commpress.compressors import host
from commpress.compressors.base import AllGather, Bucket, Compressor, Context, ParamSlot, Reduction, Transfer, over_tensors
from commpress.compressors.registry import register_compressor
from commpress.compressors.tensor_stats import TensorStats, runs
from commpress.compressors.wire.framing import frame, unframe
from commpress.compressors.wire.memory import ErrorMemory, MemoryState
from commpress.compressors.wire.seeding import tensor_key
from commpress.compressors.wire.whole import DEFAULT_MIN_NUMEL, MinNumel, average_whole, split_whole, whole_part, write_whole
from commpress.errors import ConfigError
from commpress.kernels import packed_size, sign_pack_many, sign_unpack_accumulate_many

__all__ = ["OneBitCompressor"]


@register_compressor
class OneBitCompressor(MemoryState, Compressor):
    """Signs and a mean-magnitude scale per tensor and rank, in one all-gather, with error feedback.

    ``chunk`` (a multiple of 8; 0: per tensor) gives one scale per that many elements, so a tensor
    whose rows differ in magnitude (an embedding) keeps a smaller residual. A tensor holding
    Inf/NaN on a rank has a non-finite scale that every rank decodes, so no residual is staged.
    """

    name: ClassVar[str] = "onebit"
    per_rank_state: ClassVar[tuple[str, ...]] = ("residuals",)

    def __init__(self, min_numel: MinNumel = DEFAULT_MIN_NUMEL, error_feedback: bool = True, chunk: int = 0) -> None:
        # a multiple is no range the signature can declare
        if chunk < 0 or chunk % 8:
            raise ConfigError(
                f"method 'onebit': chunk = {chunk!r} is not accepted; expected 0 (one scale per tensor) or a multiple of 8 "
                "(one scale per that many elements)"
            )
        self.chunk = chunk
        self._layouts: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
        self.min_numel = min_numel
        self.error_feedback = error_feedback
        self._memory = ErrorMemory()

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...]:
        """One all-gather: a float32 scale per run and the signs."""
        if slot.numel < self.min_numel:
            return (Transfer("all_gather", 4 * slot.numel),)
        n, run = slot.numel, self.chunk or max(slot.numel, 1)
        full, rest = divmod(n, run)  # runs of `run` elements, then a shorter one
        nbytes = full * (4 + packed_size(run, 1)) + (4 + packed_size(rest, 1) if rest else 0)
        return (Transfer("all_gather", nbytes),)

    def error_model(self, tensor: TensorStats) -> Callable[[], float]:
        """What the scaled sign misses, ``sum a^2 - n s^2`` per run of n elements (s = mean |a|)."""

        def error() -> float:
            if tensor.numel < self.min_numel:
                return 0.0
            chunks = runs(tensor.double, self.chunk or tensor.rows.numel())
            kept = sum(float(r.abs().mean(1).square().sum() * r.shape[1]) for r in chunks)  # what a scaled sign keeps
            return tensor.factor * max(0.0, tensor.energy - kept)

        return error

    def _span_array(self, layout: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The (offset, length) of every run of ``layout`` sharing one scale (``chunk`` elements, or a
        tensor) as an int64 ``[T, 2]`` array, cached per layout (small chunks make many)."""
        spans = self._layouts.get(layout)
        if spans is None:
            runs = [(o + at, min(self.chunk or n, n - at)) for o, n in layout for at in range(0, n, self.chunk or max(n, 1))]
            spans = self._layouts[layout] = np.array(runs, dtype=np.int64).reshape(-1, 2)
        return spans

    @over_tensors
    def reduce(self, bucket: Bucket, ctx: Context, slots: list[ParamSlot]) -> Reduction:
        grad = bucket.buffer
        signed, whole = split_whole(slots, self.min_numel)
        pieces = [(tensor_key(bucket, s), s.offset, tuple(s.shape)) for s in signed]
        spans = self._span_array(tuple((s.offset, s.numel) for s in signed))
        error, acc = self._memory.residuals(pieces, grad) if self.error_feedback and pieces else (None, None)
        packed, scales = sign_pack_many(grad, spans, error, acc)
        dense, dense_pieces = whole_part(grad, bucket, whole)
        gathered = yield AllGather(frame([scales, packed, dense]))
        all_scales, all_packed, all_dense = unframe(
            gathered, [(torch.float32, len(spans)), (torch.uint8, packed.numel()), (torch.float32, dense.numel())]
        )
        sign_unpack_accumulate_many(all_packed, all_scales, spans, grad, acc, ctx.rank)  # acc becomes the residual
        average = average_whole(all_dense)
        write_whole(grad, whole, dense_pieces, average)
        # decoded values are at most the largest scale: bounded scales and average mean no sum overflows
        limit = torch.finfo(grad.dtype).max
        bounded = host.flags(host.finite(all_scales, bound=limit / ctx.world_size) & host.finite(average, bound=limit))[0]
        finite = bounded or host.flags(host.finite(all_scales, average))[0]
        if finite and acc is not None:  # a non-finite step keeps the old residuals
            self._memory.stage("residual", pieces, acc)
        return True if bounded else (None if finite else False)

    def _kinds(self) -> dict[str, str]:
        """``{"residuals": {name: tensor}}`` in the state; none without error feedback."""
        return {"residuals": "residual"} if self.error_feedback else {}

    def _owner(self) -> str:
        return f"compressor 'onebit' with error_feedback = {str(self.error_feedback).lower()}"
