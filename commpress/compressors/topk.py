"""Top-k sparsification with error feedback (Stich et al., 2018; Lin et al., DGC 2018).

acc = grad + residual; from every tensor send its k = ceil(ratio·n) entries of largest
|acc| as (int32 index, value) pairs; the residual becomes acc with the sent values
removed, so nothing is lost, only delayed. All (index, value) pairs of a bucket travel
in ONE all-gather; every rank adds up all ranks' pairs and divides by the world.

Selection is per tensor (layer-wise, like DGC), not per bucket: every layer sends its
share each step, so layers with small gradients are not starved by layers with large
ones, and the result does not depend on how DDP groups parameters into buckets (its
rebuild after the first step, ``bucket_cap_mb``, a resumed run's fresh buckets).

Wire bytes per rank and bucket: k·(value bytes + 4), k the sum of the tensors' k.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch

from commpress.compressors import host
from commpress.compressors.base import AllGather, Bucket, Compressor, Context, ParamSlot, Reduction, on_dense_copy
from commpress.compressors.framing import frame, unframe
from commpress.compressors.memory import ErrorMemory
from commpress.compressors.registry import register_compressor
from commpress.compressors.seeding import check_seed, tensor_key, tensor_seed
from commpress.cuda import add_error, scatter_add_decode, topk_select
from commpress.errors import ConfigError

__all__ = ["TopKCompressor", "topk_count"]

_VALUE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: With ``selection = "auto"``, tensors up to this many elements use the exact k-th value
#: (cheap at that size); larger ones the sampled threshold.
EXACT_MAX_NUMEL = 1 << 16
_FP16_MAX = torch.finfo(torch.float16).max


def _all_finite(t: torch.Tensor) -> bool:
    """No Inf/NaN in ``t``: one float64 sum (Inf/NaN propagate, float32 values cannot overflow it)."""
    return host.flags(torch.isfinite(t.sum(dtype=torch.float64)))[0]


def topk_count(ratio: float, numel: int) -> int:
    """How many entries a tensor of ``numel`` elements sends: ceil(ratio·numel), at least 1."""
    return min(numel, max(1, math.ceil(ratio * numel))) if numel else 0


@register_compressor
class TopKCompressor(Compressor):
    """Send each tensor's largest-magnitude entries; keep the rest as a residual.

    Args:
        ratio: fraction of every tensor's entries sent per step, in (0, 1].
        value_dtype: dtype of the values on the wire: "float32", "float16" or "bfloat16"
            (the rounding error goes back into the residual, so it is not lost either).
        selection: "exact" (k-th value of all |acc|), "sampled" (threshold estimated on a sample,
            count corrected to exactly k) or "auto" (exact up to ``EXACT_MAX_NUMEL``
            elements per tensor, sampled above).
        warmup_steps: DGC-style warm-up: over the first ``warmup_steps`` steps the ratio
            falls geometrically from ``warmup_ratio`` to ``ratio`` (0: no warm-up).
        warmup_ratio: the ratio at step 0 of the warm-up, in [ratio, 1] (used when
            ``warmup_steps`` > 0).
        seed: key material of the sampled selection's random numbers (with rank, step and
            parameter name).

    Residuals are kept per parameter name (float32, shaped like the parameter) and staged
    until :meth:`end_step`.

    Non-finite gradients: a rank whose acc holds Inf/NaN sends NaN values, so every rank
    decodes a non-finite gradient and ``torch.amp.GradScaler`` skips the step everywhere;
    no rank stages a residual from such a step.
    """

    name: ClassVar[str] = "topk"
    rounds: ClassVar[int] = 1

    def __init__(
        self,
        ratio: float = 0.01,
        value_dtype: Literal["float32", "float16", "bfloat16"] = "float32",
        selection: Literal["auto", "exact", "sampled"] = "auto",
        warmup_steps: int = 0,
        warmup_ratio: float = 0.25,
        seed: int = 0,
    ) -> None:
        where = "method 'topk'"
        if not (math.isfinite(ratio) and 0 < ratio <= 1):
            raise ConfigError(f"{where}: ratio = {ratio!r} is not accepted; expected a number in (0, 1]")
        if warmup_steps < 0:
            raise ConfigError(f"{where}: warmup_steps = {warmup_steps!r} is not accepted; expected an integer >= 0")
        if warmup_steps and not (math.isfinite(warmup_ratio) and ratio <= warmup_ratio <= 1):
            raise ConfigError(
                f"{where}: warmup_ratio = {warmup_ratio!r} is not accepted; expected a number in [ratio, 1] = [{ratio}, 1]"
            )
        check_seed(where, seed)
        self.ratio = ratio
        self.value_dtype = _VALUE_DTYPES[value_dtype]
        self.selection = selection
        self.warmup_steps = warmup_steps
        self.warmup_ratio = warmup_ratio
        self.seed = seed
        self._memory = ErrorMemory()

    def ratio_at(self, step: int) -> float:
        """The ratio used at ``step`` (the hook's step counter, the one ``start_iter`` counts)."""
        if step >= self.warmup_steps:
            return self.ratio
        return max(self.ratio, self.warmup_ratio * (self.ratio / self.warmup_ratio) ** (step / self.warmup_steps))

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        self.check_dtype(bucket)
        if not bucket.buffer.is_contiguous():  # a strided view: work on a dense copy
            yield from on_dense_copy(self.reduce, bucket, ctx)
            return
        n = bucket.buffer.numel()
        slots = [s for s in bucket.slots if s.numel]
        if not slots:
            return
        if n >= 2**31:
            raise ValueError(f"compressor 'topk' sends int32 indices: a bucket holds at most 2**31 - 1 elements, got {n}")
        pieces = [(tensor_key(bucket, s), s.offset, tuple(s.shape)) for s in slots]
        residual, _ = self._memory.gather("residual", pieces, n, bucket.buffer.device)
        acc = add_error(bucket.buffer, residual.narrow(0, 0, n))
        ratio = self.ratio_at(ctx.step)
        counts = [topk_count(ratio, s.numel) for s in slots]
        k = sum(counts)
        indices, values = self._select(acc, bucket, slots, counts, ctx)
        # Inf/NaN rank first in every tensor's selection, so a non-finite acc always sends
        # a non-finite value: every rank's decode is then non-finite (no extra pass needed)
        finite = _all_finite(values)
        wire = self._to_wire(acc, indices, values) if finite else values.to(self.value_dtype)
        gathered = yield AllGather(frame([indices, wire]))
        all_indices, all_values = unframe(gathered, [(torch.int32, k), (self.value_dtype, k)])
        scatter_add_decode(all_values, all_indices, n, bucket.buffer, average=True)
        if finite and _all_finite(all_values):
            self._memory.stage("residual", pieces, acc)  # not from a non-finite step: the old residual stays

    def _select(
        self, acc: torch.Tensor, bucket: Bucket, slots: list[ParamSlot], counts: list[int], ctx: Context
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every tensor's top entries of ``acc`` as (bucket-wide int32 indices, float32
        values); the selected entries of ``acc`` are zeroed."""
        indices, values = [], []
        for slot, k in zip(slots, counts):
            exact = self.selection == "exact" or (self.selection == "auto" and slot.numel <= EXACT_MAX_NUMEL)
            seed = tensor_seed(self.seed, ctx.rank, ctx.step, tensor_key(bucket, slot))
            v, i = topk_select(acc.narrow(0, slot.offset, slot.numel), k, exact=exact, seed=seed)
            indices.append(i + slot.offset)
            values.append(v)
        return torch.cat(indices), torch.cat(values)

    def _to_wire(self, acc: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``values`` in the wire dtype; what the cast drops goes back into ``acc`` (the
        new residual) at the selected entries."""
        if self.value_dtype == torch.float32:
            return values
        clamped = values.clamp(-_FP16_MAX, _FP16_MAX) if self.value_dtype == torch.float16 else values
        wire = clamped.to(self.value_dtype)
        acc.index_put_((indices.long(),), values - wire.float(), accumulate=True)
        return wire

    def end_step(self, commit: bool) -> None:
        """Apply (``commit``) or drop the residuals the step staged."""
        self._memory.end_step(commit)

    def state_dict(self) -> dict[str, Any]:
        """The committed residual of every parameter, by name (CPU copies, float32)."""
        return {"residuals": self._memory.tensors("residual")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; buckets pick their residuals up by parameter name
        (moved to the gradients' device at first use)."""
        if set(state) != {"residuals"}:
            raise ValueError(f"compressor 'topk' expects state with key 'residuals', got keys {sorted(state)}")
        self._memory.clear()
        self._memory.load("residual", state["residuals"])
