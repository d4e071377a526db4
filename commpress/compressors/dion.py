"""Dion's power iteration over data-parallel ranks (Ahn et al., 2025): Muon's orthonormal
update of a matrix's momentum, approximated at rank r from factors the ranks average.

Per matrix, ``B = M + G`` (M: this rank's momentum); ``P = B Q``, averaged, orthonormalized;
``R = B^T P``, averaged; ``M = B - (1 - mu) P R^T``; ``Q = R`` with unit columns; the update
direction is ``P Q^T``, applied by :class:`commpress.optim.Dion`. Everything else is PowerSGD's,
the momentum being its error memory.

Not a registered method: its result is an update, not an average gradient, so it runs only at
the step of ``[dion]``, never in a DDP hook.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from commpress.compressors.base import Bucket
from commpress.compressors.lowrank import _Step
from commpress.compressors.powersgd import PowerSGDCompressor
from commpress.compressors.wire.seeding import Seed

__all__ = ["DionCompressor"]

#: Added to each column norm of R before dividing (the Dion reference's epsilon).
COLUMN_EPS = 1e-8


class DionCompressor(PowerSGDCompressor):
    """Dion's update directions of the bucket's matrices (``rank`` may be a fraction of ``min(m, n)``),
    with momentum ``mu``. A 1-D tensor is refused: Dion, like Muon, steps matrices."""

    name: ClassVar[str] = "dion"

    def __init__(self, rank: float = 16, mu: float = 0.95, seed: Seed = 0) -> None:
        super().__init__(min_compression_rate=0.0, error_feedback=True, warm_start=True, seed=seed)
        self.rank = rank  # PowerSGD's checks take whole numbers; [dion]'s table checks a fraction too
        self.mu = mu
        self._captured = 1 - mu  # M = B - (1 - mu) P R^T

    def _begin(self, bucket: Bucket) -> _Step | None:
        flat = [s.name for s in bucket.slots if len(s.shape) != 2]
        if flat:
            raise ValueError(f"[dion] steps 2-D matrices; {', '.join(flat)} is not one")
        return super()._begin(bucket)

    def _result_factor(self, rt: torch.Tensor) -> torch.Tensor:
        """Q from R (the rows of ``rt``) with unit columns."""
        return rt / (torch.linalg.vector_norm(rt, dim=2, keepdim=True) + COLUMN_EPS)
