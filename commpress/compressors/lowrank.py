"""The base class of PowerSGD and ACP-SGD: parameters, the shared steps of both
(error feedback, warm or random start, the dense part fused into the factor all-reduce,
decompression), the non-finite policy and checkpoints."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import torch

from commpress.compressors.base import Bucket, Compressor, ParamSlot
from commpress.compressors.lowrank_plan import LowRankPlan, orthonormalize
from commpress.compressors.lowrank_state import BucketState, StateStore
from commpress.errors import ConfigError

__all__ = ["LowRankCompressor"]


class LowRankCompressor(Compressor):
    """Shared machinery of the rank-``r`` compressors (speed choices: ``lowrank_plan``).

    Parameters: ``rank`` (>= 1), ``min_compression_rate`` (>= 0; a matrix is compressed
    only if it shrinks by more than this factor), ``error_feedback``, ``warm_start`` and
    ``seed`` (the shared seed of the random initial factors). Plain steps before
    compression starts are the config's top-level ``start_iter``.
    """

    def __init__(
        self,
        rank: int = 4,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
    ) -> None:
        if rank < 1:
            raise ConfigError(f"{self.name}: rank = {rank!r} is not accepted; expected an integer >= 1")
        if not (min_compression_rate >= 0 and math.isfinite(min_compression_rate)):
            raise ConfigError(
                f"{self.name}: min_compression_rate = {min_compression_rate!r} is not accepted; expected a finite number >= 0"
            )
        self.rank = rank
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self._store = StateStore()

    # ---- per-bucket state -------------------------------------------------------------

    def _plan(self, slots: tuple[ParamSlot, ...]) -> LowRankPlan:
        return LowRankPlan.build(slots, self.rank, self.min_compression_rate)

    def _state(self, bucket: Bucket) -> BucketState:
        """This bucket's state; a new one, taking over each parameter's error and factors
        from where it was before, when the layout changed (DDP rebuilds its buckets)."""
        return self._store.get(bucket, self._plan, lambda st: self._random_qt(bucket, st, 0))

    def _random_qt(self, bucket: Bucket, st: BucketState, draw: int) -> torch.Tensor:
        """Random transposed Q factors, the same on every rank without communication:
        seeded by (seed, bucket index, layout, draw)."""
        layout = tuple((s.name, tuple(s.shape)) for s in st.plan.slots)
        text = repr((self.seed, bucket.index, layout, draw)).encode()
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1)
        return torch.randn(st.plan.q_numel, generator=gen)

    def _start_qs(self, bucket: Bucket, st: BucketState) -> list[torch.Tensor]:
        """Orthonormalized Q (count, m, r) of every batch: the warm start, or a random draw
        (a new draw every step when warm start is off)."""
        warm = self.warm_start and st.q is not None
        qt = st.q if warm else self._random_qt(bucket, st, 0 if self.warm_start else st.steps)
        return [orthonormalize(v.transpose(1, 2)) for v in st.plan.qt_views(qt)]

    def _begin(self, bucket: Bucket) -> tuple[BucketState, list[torch.Tensor]] | None:
        """The shared start of a step: check the dtype, then this bucket's state and its
        matrices ``M`` (see :meth:`_matrices`); None for an empty bucket."""
        self.check_dtype(bucket)
        if bucket.buffer.numel() == 0:
            return None
        st = self._state(bucket)
        return st, self._matrices(bucket, st)

    def _matrices(self, bucket: Bucket, st: BucketState) -> list[torch.Tensor]:
        """``M`` of every batch, in fp32: ``grad + error`` written into the spare error
        buffer (error feedback), else the gradients themselves (fp32) or fp32 copies."""
        plan, grad = st.plan, bucket.buffer
        if self.error_feedback:
            if st.error is None:
                st.error = torch.zeros(grad.numel(), dtype=torch.float32)
            if st.spare is None:
                st.spare = torch.zeros_like(st.error)
            return [torch.add(b.view(st.error), b.view(grad), out=b.view(st.spare)) for b in plan.batches]
        if grad.dtype == torch.float32:
            return [b.view(grad) for b in plan.batches]
        return [b.view(grad).float() for b in plan.batches]

    @staticmethod
    def _payload(bucket: Bucket, st: BucketState, factor_numel: int, world_size: int) -> torch.Tensor:
        """A fresh fp32 tensor: room for the factors, then the dense elements divided by
        the world size, so that they ride in the same all-reduce."""
        plan = st.plan
        out = torch.empty(factor_numel + plan.dense_numel, dtype=torch.float32)
        if plan.dense_numel:
            torch.div(bucket.buffer[plan.dense_index], world_size, out=out[factor_numel:])
        return out

    @staticmethod
    def _write_dense(summed: torch.Tensor, bucket: Bucket, st: BucketState, factor_numel: int) -> None:
        """Copy the averaged dense elements (after the factors in ``summed``) into the bucket."""
        plan = st.plan
        if plan.dense_numel:
            bucket.buffer.index_copy_(0, plan.dense_index, summed[factor_numel:].to(bucket.buffer.dtype))

    @staticmethod
    def _usable(summed: torch.Tensor, bucket: Bucket, st: BucketState) -> bool:
        """Whether the all-reduced ``summed`` is finite. If not, the compressed part of the
        bucket is set to NaN and the caller returns without touching error or warm start.
        Every rank sees the same sums, so all ranks agree; the non-finite gradient makes
        torch.amp's GradScaler skip the step."""
        if bool(torch.isfinite(summed).all()):
            return True
        for b in st.plan.batches:
            b.view(bucket.buffer).fill_(float("nan"))
        return False

    def _decompress(
        self, bucket: Bucket, st: BucketState, ms: list[torch.Tensor], ps: list[torch.Tensor], qts: list[torch.Tensor]
    ) -> None:
        """Write ``P Qt`` (already averaged) into the bucket; with error feedback the new
        error ``M - P Qt`` is formed in place in the spare buffer, which becomes current."""
        grad = bucket.buffer
        for b, m, p, qt in zip(st.plan.batches, ms, ps, qts):
            if self.error_feedback:
                m.baddbmm_(p, qt, alpha=-1)
            out = b.view(grad)
            if grad.dtype == torch.float32:
                torch.bmm(p, qt, out=out)
            else:
                out.copy_(torch.bmm(p, qt))
        if self.error_feedback:
            st.error, st.spare = st.spare, st.error
        st.steps += 1

    # ---- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Per bucket: slots, completed steps, error buffer and factors (copies)."""
        return {"buckets": {index: st.to_dict() for index, st in self._store.buckets.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a bucket whose layout then differs takes its
        parameters' state over as at a DDP bucket rebuild."""
        if set(state) != {"buckets"}:
            raise ValueError(f"{self.name} state must have exactly the key 'buckets', got {sorted(state)}")
        store = StateStore()
        for index, saved in state["buckets"].items():
            store.buckets[int(index)] = BucketState.from_dict(saved, self._plan)
        self._store = store
