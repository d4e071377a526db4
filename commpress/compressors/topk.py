"""Top-k sparsification with error feedback (Stich et al., 2018) or DGC's momentum
correction (Lin et al., 2018, :mod:`commpress.compressors.dgc`).

acc = grad + residual; each tensor sends its k = ceil(ratio·n) entries of largest |acc| as
(int32 index, value) pairs, and the residual keeps the rest, so nothing is lost, only delayed.
A bucket's pairs travel in ONE all-gather; every rank sums all pairs and divides by the world.

Selection is per tensor, not per bucket, so small gradients are not starved by large ones and
the result does not depend on DDP's bucketing. Tensors under ``min_numel`` travel whole.

Wire bytes per rank and bucket: k·(value bytes + 4) + 4·d (d: elements sent whole); with
``value_bits`` = b, Σ_t (4·k_t + ⌈k_t·b/8⌉ + 8) + 4·d.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

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
from commpress.compressors.dgc import clip_local, correct, dense_momentum, mask, owed_velocity
from commpress.compressors.ladder import pool
from commpress.compressors.registry import register_compressor
from commpress.compressors.tensor_stats import TensorStats
from commpress.compressors.wire.framing import frame, unframe
from commpress.compressors.wire.memory import ErrorMemory, MemoryState, Piece
from commpress.compressors.wire.seeding import Seed, tensor_key, tensor_seeds
from commpress.compressors.wire.sparse_values import ValueCodec
from commpress.compressors.wire.whole import DEFAULT_MIN_NUMEL, MinNumel, average_whole, split_whole, whole_part, write_whole
from commpress.errors import ConfigError
from commpress.kernels import derive_seed, scatter_add_decode, topk_select_many
from commpress.schema import Bounds

__all__ = ["DEFAULT_MIN_NUMEL", "TopKCompressor", "topk_count"]

_VALUE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: With ``selection = "auto"``, tensors up to this size use the exact k-th value, larger ones a sampled threshold.
EXACT_MAX_NUMEL = 1 << 16
#: Folded into the value codes' random keys so they differ from the sampled selection's.
_VALUE_STREAM = 0x76616C75
_FP16_MAX = torch.finfo(torch.float16).max
_DENSITY_STEPS = range(-3, 7)  # a layer-wise plan's densities: the configured ratio * 2**j


def topk_count(ratio: float, numel: int) -> int:
    """How many entries a tensor of ``numel`` elements sends: ceil(ratio·numel), at least 1."""
    return min(numel, max(1, math.ceil(ratio * numel))) if numel else 0


@register_compressor
class TopKCompressor(MemoryState, Compressor):
    """Send each tensor's largest-magnitude entries; keep the rest as a residual (or, with
    ``dgc``, as DGC's velocity).

    Args:
        value_dtype, value_bits: the values on the wire, in a dtype or as b-bit stochastic codes
            (:mod:`commpress.compressors.wire.sparse_values`); what they drop joins the residual.
        selection: "exact" k-th value, "sampled" (threshold from a sample, count corrected to
            exactly k) or "auto" (exact up to ``EXACT_MAX_NUMEL``).
        warmup_steps, warmup_ratio: DGC-style warm-up, the ratio falling geometrically from
            ``warmup_ratio`` to ``ratio``.
        dgc: DGC's momentum correction replaces error feedback; the optimizer runs without
            momentum (``commpress.register(..., optimizer=opt)`` hands it over).
        momentum_masking: DGC's factor masking. Off by default: it drops the momentum still due
            to sent entries, so at ratio 1 DGC becomes SGD without momentum (docs/quantization.md).
        clip_norm: DGC's local gradient clipping (:func:`commpress.compressors.dgc.clip_local`).

    A rank whose acc holds Inf/NaN sends a non-finite value, so every rank skips the step.
    """

    name: ClassVar[str] = "topk"
    per_rank_state: ClassVar[tuple[str, ...]] = ("residuals", "momentum", "velocity")
    knob: ClassVar[str | None] = "ratio"

    def __init__(
        self,
        ratio: Annotated[float, Bounds(gt=0, le=1)] = 0.01,
        value_dtype: Literal["float32", "float16", "bfloat16"] = "float32",
        value_bits: Literal[2, 4, 8] | None = None,
        selection: Literal["auto", "exact", "sampled"] = "auto",
        warmup_steps: Annotated[int, Bounds(ge=0)] = 0,
        warmup_ratio: float = 0.25,
        min_numel: MinNumel = DEFAULT_MIN_NUMEL,
        dgc: bool = False,
        momentum: Annotated[float, Bounds(ge=0, lt=1)] | None = None,
        momentum_masking: bool = False,
        clip_norm: Annotated[float, Bounds(ge=0, note="0: off")] = 0.0,
        seed: Seed = 0,
    ) -> None:
        where = "method 'topk'"
        if warmup_steps and not ratio <= warmup_ratio <= 1:
            raise ConfigError(
                f"{where}: warmup_ratio = {warmup_ratio!r} is not accepted; expected a number in [ratio, 1] = [{ratio}, 1]"
            )
        if momentum is not None and not dgc:
            raise ConfigError(f"{where}: momentum = {momentum!r} is not accepted without dgc = true (only DGC applies momentum)")
        if momentum_masking and not dgc:
            raise ConfigError(f"{where}: momentum_masking = true is not accepted without dgc = true")
        if value_bits is not None and value_dtype != "float32":
            raise ConfigError(
                f"{where}: value_bits = {value_bits!r} is not accepted with value_dtype = {value_dtype!r}; "
                "quantized values replace value_dtype: leave value_dtype at 'float32'"
            )
        self.ratio = ratio
        self.value_dtype = _VALUE_DTYPES[value_dtype]
        self.value_bits = value_bits
        self._codec = ValueCodec(value_bits) if value_bits is not None else None
        self.selection = selection
        self.warmup_steps = warmup_steps
        self.warmup_ratio = warmup_ratio
        self.min_numel = min_numel
        self.dgc = dgc
        #: DGC's momentum; set by :func:`commpress.hooks.optimizer.hand_over_momentum` when not configured
        self.momentum = momentum
        self.momentum_masking = momentum_masking
        self.clip_norm = clip_norm
        self.seed = seed
        self._memory = ErrorMemory()

    def ratio_at(self, step: int) -> float:
        """The ratio used at ``step`` (the hook's step counter, the one ``start_iter`` counts)."""
        if step >= self.warmup_steps:
            return self.ratio
        return max(self.ratio, self.warmup_ratio * (self.ratio / self.warmup_ratio) ** (step / self.warmup_steps))

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...]:
        """One all-gather: an int32 index and a value per kept entry (the ratio after warm-up)."""
        if slot.numel < self.min_numel:
            return (Transfer("all_gather", 4 * slot.numel),)
        k = topk_count(self.ratio, slot.numel)
        if self._codec is not None:
            return (Transfer("all_gather", 4 * k + self._codec.nbytes(k)),)
        return (Transfer("all_gather", k * (4 + self.value_dtype.itemsize)),)

    def params_for_ratio(self, ratio: float, slots: Sequence[ParamSlot]) -> dict[str, Any]:
        """The ``ratio`` whose (index, value) pairs carry ``ratio`` of float32's bytes, up to one
        entry (with ``value_bits`` also its (min, scale) and a padding byte) more per tensor."""
        value_bytes = self.value_bits / 8 if self.value_bits is not None else self.value_dtype.itemsize
        return {"ratio": min(1.0, ratio * 4 / (value_bytes + 4))}

    def ladder(self, params: Mapping[str, Any]) -> list[Setting]:
        """Densities around the ratio, below 1/2 (beyond it the pairs outweigh the tensor), then the
        pool; with DGC, whose tensors must keep the momentum it applies, densities only, up to 1."""
        ratio, top = float(self.ratio), 1.0 if self.dgc else 0.5
        densities = sorted({min(top, ratio * 2.0**j) for j in _DENSITY_STEPS} | ({1.0} if self.dgc else set()))
        own = [(self.name, self._at(params, d)) for d in densities if d != ratio and (d < top or self.dgc)]
        return [(self.name, dict(params)), *own, *([] if self.dgc else pool(self.name, params, (1, 2, 4, 8)))]

    def _at(self, params: Mapping[str, Any], ratio: float) -> dict[str, Any]:
        """``params`` at ``ratio`` (a warm-up starts at least there)."""
        warmup = {"warmup_ratio": max(float(self.warmup_ratio), ratio)} if self.warmup_steps else {}
        return {**params, "ratio": ratio, **warmup}

    def error_model(self, tensor: TensorStats) -> Callable[[], float]:
        """The squares of every entry but the k largest (0 for a tensor sent whole)."""
        k = topk_count(self.ratio, tensor.rows.numel())
        tensor.want_top(k)

        def error() -> float:
            if tensor.numel < self.min_numel or topk_count(self.ratio, tensor.numel) == tensor.numel:
                return 0.0  # sent whole, or every entry sent: exact
            return tensor.factor * max(0.0, tensor.energy - tensor.top_kept(k))

        return error

    def owed(self, entries: Mapping[str, Any]) -> torch.Tensor | None:
        """The residual, with DGC the velocity plus the momentum's next contribution."""
        return owed_velocity(entries, self.momentum or 0.0) if self.dgc else entries.get("residuals")

    def takes_state_of(self, previous: Compressor) -> bool:
        """Top-k's state converts to another ratio, not between DGC and error feedback."""
        return super().takes_state_of(previous) and previous.applies_momentum == self.dgc

    @property
    def applies_momentum(self) -> bool:
        """With ``dgc``: DGC's momentum correction applies the optimizer's momentum."""
        return self.dgc

    @over_tensors
    def reduce(self, bucket: Bucket, ctx: Context, slots: list[ParamSlot]) -> Reduction:
        n = bucket.buffer.numel()
        if n >= 2**31:
            raise ValueError(f"compressor 'topk' sends int32 indices: a bucket holds at most 2**31 - 1 elements, got {n}")
        if self.dgc and self.momentum is None:
            raise ConfigError(
                "method 'topk' with dgc = true has no momentum: pass optimizer= to commpress.register (it hands the "
                "optimizer's momentum over), or set params.momentum and run the optimizer without momentum"
            )
        sparse, whole = split_whole(slots, self.min_numel)
        pieces = [(tensor_key(bucket, s), s.offset, tuple(s.shape)) for s in sparse]
        grad = clip_local(bucket.buffer, slots, self.clip_norm, ctx.world_size) if self.clip_norm else bucket.buffer
        counts = [topk_count(self.ratio_at(ctx.step), s.numel) for s in sparse]
        k = sum(counts)
        acc, u, error = self._accumulate(grad, pieces)
        seeds = tensor_seeds(self.seed, ctx.rank, ctx.step, bucket, sparse)
        indices, values = self._select(acc, error, grad, sparse, counts, seeds)
        if u is not None and self.momentum_masking:
            mask(u, indices)
        # Inf/NaN rank first in a selection, so a non-finite acc always sends a non-finite value
        finite = host.flags(host.finite(values))[0]
        wire = self._to_wire(acc, indices, values, counts, seeds, finite)
        dense, dense_pieces = whole_part(grad, bucket, whole)
        gathered = yield AllGather(frame([indices, dense, *wire]))
        values_layout = self._codec.layout(counts) if self._codec is not None else [(self.value_dtype, k)]
        all_indices, all_dense, *all_wire = unframe(gathered, [(torch.int32, k), (torch.float32, dense.numel()), *values_layout])
        all_values = self._codec.decode(*all_wire, counts) if self._codec is not None else all_wire[0]
        scatter_add_decode(all_values, all_indices, n, bucket.buffer, average=True)
        average = average_whole(all_dense)
        if self.dgc and dense_pieces:  # the tensors sent whole: their momentum U = m·U + average
            average = dense_momentum(self._memory, dense_pieces, average, self.momentum)
        write_whole(bucket.buffer, whole, dense_pieces, average)
        # finite if the values and `average` are, bounded so that no sum overflows the bucket's dtype
        limit = torch.finfo(bucket.buffer.dtype).max
        bounded = host.flags(host.finite(all_values, bound=limit / ctx.world_size) & host.finite(average, bound=limit))[0]
        received = bounded or host.flags(host.finite(all_values, all_dense))[0]
        if finite and received:  # not from a non-finite step: the old state stays
            self._stage(pieces, acc, u, dense_pieces, average)
        return True if bounded else (False if not received else None)

    def _accumulate(
        self, grad: torch.Tensor, pieces: list[Piece]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(acc, DGC's ``u``, residual ``error``): acc is DGC's velocity, or a spare for grad + error."""
        if not pieces:
            return torch.empty(0, dtype=torch.float32, device=grad.device), None, None
        if self.dgc:
            u, v = correct(self._memory, pieces, grad, self.momentum)
            return v, u, None
        residual, out = self._memory.residuals(pieces, grad)
        return out, None, residual  # the spare itself: the memory tracks buffers by identity

    def _stage(
        self, pieces: list[Piece], acc: torch.Tensor, u: torch.Tensor | None, dense_pieces: list[Piece], average: torch.Tensor
    ) -> None:
        """Stage the residuals, or DGC's velocity and momentum (tensors sent whole: momentum only)."""
        if pieces and not self.dgc:
            self._memory.stage("residual", pieces, acc)
        if pieces and self.dgc:
            self._memory.stage("velocity", pieces, acc)
            self._memory.stage("momentum", pieces, u)
        if dense_pieces and self.dgc:
            self._memory.stage("momentum", dense_pieces, average)

    def _select(
        self,
        acc: torch.Tensor,
        error: torch.Tensor | None,
        grad: torch.Tensor,
        slots: list[ParamSlot],
        counts: list[int],
        seeds: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every tensor's top entries of ``acc`` (set to grad + ``error`` if given) as (indices, values), zeroed in ``acc``."""
        if not slots:
            return torch.empty(0, dtype=torch.int32, device=acc.device), acc.new_empty(0)
        spans = [(s.offset, s.numel) for s in slots]
        exact = [self.selection == "exact" or (self.selection == "auto" and s.numel <= EXACT_MAX_NUMEL) for s in slots]
        values, indices = topk_select_many(acc, spans, counts, seeds, exact, grad=None if error is None else grad, error=error)
        return indices, values

    def _to_wire(
        self, acc: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, counts: list[int], seeds: list[int], finite: bool
    ) -> list[torch.Tensor]:
        """``values`` as frame pieces (``value_dtype``, or the codec's); if ``finite``, what they drop goes back into ``acc``."""
        if self._codec is not None:
            wire, sent = self._codec.encode(values, counts, [derive_seed(s, _VALUE_STREAM) for s in seeds])
        elif self.value_dtype == torch.float32 or not finite:  # Inf is not clamped away: it must reach every rank
            return [values.to(self.value_dtype)]
        else:
            clamped = values.clamp(-_FP16_MAX, _FP16_MAX) if self.value_dtype == torch.float16 else values
            wire = [clamped.to(self.value_dtype)]
            sent = wire[0].float()
        if finite:
            acc.index_put_((indices.long(),), values - sent, accumulate=True)
        return wire

    def _kinds(self) -> dict[str, str]:
        """``{"residuals": ...}`` in the state, or with DGC ``{"momentum": ..., "velocity": ...}``."""
        return {"momentum": "momentum", "velocity": "velocity"} if self.dgc else {"residuals": "residual"}
