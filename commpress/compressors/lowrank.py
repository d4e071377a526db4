"""The base class of the rank-r compressors (PowerSGD, ACP-SGD, Dion): error feedback, warm or
random start, the dense part riding in the factor all-reduce, decompression, non-finite policy.

State is kept per parameter name in an :class:`ErrorMemory` (kinds "error", "q", "p"), so it
follows a parameter into whatever bucket DDP puts it.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

import torch

from commpress.compressors import host
from commpress.compressors.base import Bucket, Compressor, Context, ParamSlot, Reduction, Setting
from commpress.compressors.ladder import pool
from commpress.compressors.lowrank_plan import LowRankPlan, matrix_rank, matrix_shape, orthonormalize
from commpress.compressors.tensor_stats import TensorStats
from commpress.compressors.wire.memory import ErrorMemory, MemoryState, Piece
from commpress.compressors.wire.seeding import Seed, shared_normal, stream_starts, tensor_key
from commpress.schema import Bounds

__all__ = ["LowRankCompressor"]

_STATE_KEYS = ("error", "p", "q")
_RANK_STEPS = range(-2, 4)  # a layer-wise plan's ranks: the configured rank * 2**j


@dataclass(eq=False)
class _Layout:
    """What a bucket's slots and device determine: the plan, state locations, random streams, buffers."""

    slots: tuple[ParamSlot, ...]
    device: torch.device
    plan: LowRankPlan
    names: list[str]  # of the compressed matrices, in factor order
    errors: list[Piece]  # error entries in the bucket's flat layout
    qs: list[Piece]  # transposed Q (r x m) in the flat Q layout
    ps: list[Piece]  # P (n x r) in the flat P layout
    starts: torch.Tensor | None = None  # random-stream counters of the Q layout, made at first use
    buffers: list[torch.Tensor] = field(default_factory=list)  # M buffers to reuse (double buffering)


@dataclass(eq=False)
class _Step:
    """One bucket's step in progress."""

    layout: _Layout
    ms: list[torch.Tensor]  # M = grad + error of every batch (fp32)
    m_buffer: torch.Tensor | None  # the flat buffer the ms view (with error feedback)


class LowRankCompressor(MemoryState, Compressor):
    """Shared machinery of the rank-``r`` compressors (batching and layout: ``lowrank_plan``); a matrix
    is compressed only if it shrinks by more than ``min_compression_rate``."""

    per_rank_state: ClassVar[tuple[str, ...]] = ("error",)  # the factors are all-reduced: the same everywhere
    knob: ClassVar[str | None] = "rank"

    def __init__(
        self,
        rank: Annotated[int, Bounds(ge=1)] = 4,
        min_compression_rate: Annotated[float, Bounds(ge=0)] = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: Seed = 0,
    ) -> None:
        self.rank = rank
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self._memory = ErrorMemory()
        self._layouts: dict[int, _Layout] = {}

    # ---- the shared steps --------------------------------------------------------------

    def _layout(self, bucket: Bucket) -> _Layout:
        slots, device = tuple(bucket.slots), bucket.buffer.device
        lay = self._layouts.get(bucket.index)
        if lay is not None and lay.slots == slots and lay.device == device:
            return lay
        plan = LowRankPlan.build(slots, self.rank, self.min_compression_rate, device)
        names = [tensor_key(bucket, f.slot) for f in plan.factors]
        lay = _Layout(
            slots,
            device,
            plan,
            names,
            errors=[(name, f.slot.offset, tuple(f.slot.shape)) for name, f in zip(names, plan.factors)],
            qs=[(name, f.q_offset, (f.rank, f.m)) for name, f in zip(names, plan.factors)],
            ps=[(name, f.p_offset, (f.n, f.rank)) for name, f in zip(names, plan.factors)],
        )
        self._layouts[bucket.index] = lay
        return lay

    def _random_qt(self, lay: _Layout, step: int) -> torch.Tensor:
        """Random transposed Q factors, from (seed, parameter name, step) only: the same on every
        rank without communication, whatever the bucket layout."""
        if lay.starts is None:
            lay.starts = stream_starts(self.seed, [(n, f.rank * f.m) for n, f in zip(lay.names, lay.plan.factors)], lay.device)
        return shared_normal(lay.starts, step)

    def _start_qs(self, lay: _Layout, step: int) -> list[torch.Tensor]:
        """Orthonormalized Q (count, m, r) of every batch: the warm start if any, else a random draw."""
        if self.warm_start:
            qt, _ = self._memory.gather("q", lay.qs, lay.plan.q_numel, lay.device, fill=lambda: self._random_qt(lay, step))
        else:
            qt = self._random_qt(lay, step)
        return [orthonormalize(v.transpose(1, 2)) for v in lay.plan.qt_views(qt)]

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        """Start the step (:meth:`_begin`), then the method's collectives (:meth:`_rounds`)."""
        step = self._begin(bucket)
        if step is None:
            return None
        return (yield from self._rounds(bucket, ctx, step))

    @abstractmethod
    def _rounds(self, bucket: Bucket, ctx: Context, step: _Step) -> Reduction:
        """The method's collectives for a started step (``step`` from :meth:`_begin`)."""

    def _begin(self, bucket: Bucket) -> _Step | None:
        """Check the dtype, form the layout and ``M`` of every batch in fp32: ``grad + error`` in a buffer
        that is not committed state, or the gradients; None for an empty bucket."""
        self.check_dtype(bucket)
        if bucket.buffer.numel() == 0:
            return None
        lay, grad = self._layout(bucket), bucket.buffer
        batches = lay.plan.batches
        if not batches or not self.error_feedback:  # the gradients' own views if they are fp32
            return _Step(lay, [b.view(grad).float() for b in batches], None)
        error, _ = self._memory.gather("error", lay.errors, grad.numel(), lay.device)
        if not self._memory.holds(error):  # a fresh gathered copy: M in place
            lay.buffers = [error]
            return _Step(lay, [b.view(error).add_(b.view(grad)) for b in batches], error)
        # the committed error itself: M goes to the other buffer, if no entry lives there
        out = next((b for b in lay.buffers if b is not error and not self._memory.holds(b)), None)
        if out is None:
            out = torch.empty(grad.numel(), dtype=torch.float32, device=lay.device)
        lay.buffers = [error, out]
        return _Step(lay, [torch.add(b.view(error), b.view(grad), out=b.view(out)) for b in batches], out)

    @staticmethod
    def _payload(bucket: Bucket, plan: LowRankPlan, factor_numel: int, world_size: int) -> torch.Tensor:
        """A fresh fp32 tensor: room for the factors, then the dense elements divided by the world size."""
        out = torch.empty(factor_numel + plan.dense_numel, dtype=torch.float32, device=bucket.buffer.device)
        if plan.dense_numel:
            dense = bucket.buffer.index_select(0, plan.dense_index)
            torch.div(dense, world_size, out=out.narrow(0, factor_numel, plan.dense_numel))
        return out

    @staticmethod
    def _write_dense(summed: torch.Tensor, bucket: Bucket, plan: LowRankPlan, factor_numel: int) -> None:
        """Copy the averaged dense elements (after the factors in ``summed``) into the bucket."""
        if plan.dense_numel:
            dense = summed.narrow(0, factor_numel, plan.dense_numel).to(bucket.buffer.dtype)
            bucket.buffer.index_copy_(0, plan.dense_index, dense)

    @staticmethod
    def _usable(summed: torch.Tensor, bucket: Bucket, plan: LowRankPlan, also: torch.Tensor | None = None) -> bool:
        """Whether ``summed`` is finite and ``also`` true (one host read). If not, the compressed part
        is set to NaN and nothing is staged; every rank sees the same sums, so all skip the step."""
        flag = host.finite(summed) if also is None else host.finite(summed) & also
        if host.flags(flag)[0]:
            return True
        for b in plan.batches:
            b.view(bucket.buffer).fill_(float("nan"))
        return False

    #: the share of ``P Qt`` error feedback takes off M (Dion keeps some as momentum)
    _captured: float = 1.0

    def _result_factor(self, qt: torch.Tensor) -> torch.Tensor:
        """The right factor the bucket gets: ``Qt`` itself (Dion: rows at unit length)."""
        return qt

    def _decompress(self, bucket: Bucket, step: _Step, ps: list[torch.Tensor], qts: list[torch.Tensor]) -> None:
        """Write the averaged ``P Qt`` into the bucket; with error feedback stage ``M - P Qt``, formed in M."""
        grad, lay = bucket.buffer, step.layout
        for b, m, p, qt in zip(lay.plan.batches, step.ms, ps, qts):
            if self.error_feedback:
                m.baddbmm_(p, qt, alpha=-self._captured)
            qt = self._result_factor(qt)
            out = b.view(grad)
            if grad.dtype == torch.float32:
                torch.bmm(p, qt, out=out)
            else:
                out.copy_(torch.bmm(p, qt))
        if step.m_buffer is not None:
            self._memory.stage("error", lay.errors, step.m_buffer)

    # ---- bytes, the rank for a ratio, state across ranks --------------------------------

    def factor_numels(self, slot: ParamSlot) -> tuple[int, int] | None:
        """(P, Q) elements of ``slot`` as :meth:`LowRankPlan.build` compresses it; None: sent uncompressed."""
        shape = matrix_shape(slot, self.rank, self.min_compression_rate)
        if shape is None:
            return None
        r = matrix_rank(self.rank, *shape)
        return shape[0] * r, shape[1] * r

    def _rank_for_ratio(self, ratio: float, slots: Sequence[ParamSlot], sent: Callable[[int, int], float]) -> dict[str, Any]:
        """The largest rank r >= 1 with ``r sum(sent(n, m)) <= ratio sum(n m)`` over the matrices,
        ``sent(n, m)`` being the numbers sent per unit of rank (matrices left uncompressed send more)."""
        mats = [(s.shape[0], math.prod(s.shape[1:])) for s in slots if len(s.shape) >= 2]
        full = sum(n * m for n, m in mats)
        per_rank = sum(sent(n, m) for n, m in mats)
        return {"rank": max(1, math.floor(ratio * full / per_rank)) if per_rank else 1}

    def ladder(self, params: Mapping[str, Any]) -> list[Setting]:
        """Ranks from 1/4 to 8 times the configured rank, then the pool (no other low rank)."""
        ranks = sorted({max(1, int(self.rank * 2.0**j)) for j in _RANK_STEPS})
        own = [(self.name, {**params, "rank": r}) for r in ranks if r != self.rank]
        return [(self.name, dict(params)), *own, *pool(self.name, params)]

    def error_model(self, tensor: TensorStats) -> Callable[[], float]:
        """The squared singular values beyond the rank (the best rank-r approximation, which the
        warm-started power iteration approaches); 0 where the tensor is sent uncompressed."""
        tensor.want_rank(self.rank)

        def error() -> float:
            shape = matrix_shape(ParamSlot("t", torch.Size(tensor.shape), 0), self.rank, self.min_compression_rate)
            if shape is None:
                return 0.0
            s = tensor.singular(*shape)
            if len(s) == min(shape):  # every singular value: the tail itself
                return float(s[self.rank :].square().sum())
            return max(0.0, tensor.whole_energy - float(s[: self.rank].square().sum()))

        return error

    def owed(self, entries: Mapping[str, Any]) -> torch.Tensor | None:
        """With error feedback, the error ``M - P Q^T``."""
        return entries.get("error")

    def adapt_state(self, state: dict[str, Any], previous: Compressor) -> dict[str, Any]:
        """A new rank keeps the error buffers and restarts the warm start (the factors' width changed)."""
        if getattr(previous, "rank", None) == self.rank:
            return state
        return {**state, "q": {}, "p": {}}

    # ---- steps and checkpoints ---------------------------------------------------------

    def _kinds(self) -> dict[str, str]:
        """By parameter name: "error" (shaped like the parameter), "q" (r x m, transposed), "p" (n x r)."""
        return dict(zip(_STATE_KEYS, _STATE_KEYS))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; factors that no longer fit (another ``rank``) are drawn afresh."""
        if sorted(state) != list(_STATE_KEYS):
            raise ValueError(f"{self.name} state must have exactly the keys {list(_STATE_KEYS)}, got {sorted(state)}")
        super().load_state_dict(state)
