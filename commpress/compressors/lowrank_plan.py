"""How the low-rank compressors see a bucket: batches of same-shape matrices plus an
uncompressed ("dense") rest, and batched orthonormalization.

Same-shape matrices usually sit at equally spaced offsets (one per transformer block), so a
batch is a strided 3-D *view* of the flat buffer and one ``torch.bmm`` handles every layer of
that shape without copies. The error buffer is double-buffered: ``M = grad + error`` goes into
the spare buffer, which becomes the new error in place, so the old error stays intact until
the step commits. ``Q`` is kept transposed (r x m), which makes ``Q = M^T P`` the fast
``P^T M`` product. :attr:`LowRankPlan.factors` locates each matrix's state, stored by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from commpress.compressors.base import ParamSlot

__all__ = ["Factor", "LowRankPlan", "MatrixBatch", "orthonormalize"]


def orthonormalize(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning those of each matrix of ``x`` (count x n x r, r <= n), by batched
    Householder QR: unlike Gram-Schmidt it needs no epsilon for zero or rank-deficient input."""
    return torch.linalg.qr(x).Q


@dataclass(frozen=True)
class MatrixBatch:
    """``count`` n x m gradient matrices at offsets ``first + i * stride``, approximated at ``rank``."""

    first: int
    stride: int
    count: int
    n: int
    m: int
    rank: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The matrices as one (count, n, m) view of ``flat`` (no copy)."""
        return flat.as_strided((self.count, self.n, self.m), (self.stride, self.m, 1), flat.storage_offset() + self.first)

    @property
    def p_numel(self) -> int:
        return self.count * self.n * self.rank

    @property
    def q_numel(self) -> int:
        return self.count * self.m * self.rank


@dataclass(frozen=True)
class Factor:
    """One compressed matrix: its slot and its offsets in the flat Q (r x m) and P (n x r) buffers."""

    slot: ParamSlot
    n: int
    m: int
    rank: int
    q_offset: int
    p_offset: int


@dataclass(frozen=True, eq=False)
class LowRankPlan:
    """How one bucket is compressed: its matrix batches and the positions of the dense elements
    (1-D tensors and matrices that would not shrink by ``min_compression_rate``)."""

    slots: tuple[ParamSlot, ...]
    batches: tuple[MatrixBatch, ...]
    dense_index: torch.Tensor  # int64 positions in the bucket buffer, ascending
    factors: tuple[Factor, ...]  # every compressed matrix, in factor-buffer order

    @classmethod
    def build(
        cls, slots: Sequence[ParamSlot], rank: float, min_compression_rate: float, device: torch.device | None = None
    ) -> LowRankPlan:
        """Group compressible matrices by shape, then into runs of equal spacing."""
        by_shape: dict[tuple[int, int], list[int]] = {}
        dense: list[torch.Tensor] = []
        by_offset: dict[int, ParamSlot] = {}
        for s in slots:
            if s.numel == 0:
                continue
            shape = matrix_shape(s, rank, min_compression_rate)
            if shape is not None:
                by_shape.setdefault(shape, []).append(s.offset)
                by_offset[s.offset] = s
            else:
                dense.append(torch.arange(s.offset, s.offset + s.numel, device=device))
        batches = []
        for (n, m), offsets in by_shape.items():
            for first, stride, count in _equal_runs(sorted(offsets)):
                batches.append(MatrixBatch(first, stride if count > 1 else n * m, count, n, m, matrix_rank(rank, n, m)))
        index = torch.cat(dense) if dense else torch.zeros(0, dtype=torch.int64, device=device)
        factors, q_at, p_at = [], 0, 0
        for b in batches:
            for k in range(b.count):
                factors.append(Factor(by_offset[b.first + k * b.stride], b.n, b.m, b.rank, q_at, p_at))
                q_at += b.rank * b.m
                p_at += b.n * b.rank
        return cls(tuple(slots), tuple(batches), index.sort().values, tuple(factors))

    @property
    def p_numel(self) -> int:
        return sum(b.p_numel for b in self.batches)

    @property
    def q_numel(self) -> int:
        return sum(b.q_numel for b in self.batches)

    @property
    def dense_numel(self) -> int:
        return self.dense_index.numel()

    def p_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Consecutive (count, n, r) blocks of ``flat``: the P factor of every batch."""
        return _split(flat, [(b.count, b.n, b.rank) for b in self.batches])

    def qt_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Consecutive (count, r, m) blocks of ``flat``: the transposed Q factor of every batch."""
        return _split(flat, [(b.count, b.rank, b.m) for b in self.batches])


def matrix_rank(rank: float, n: int, m: int) -> int:
    """The rank of an n x m matrix: ``min(rank, n, m)``, or for a fraction (Dion's) that share of ``min(n, m)``."""
    if isinstance(rank, int):
        return min(rank, n, m)
    return max(1, int(rank * min(n, m)))


def matrix_shape(slot: ParamSlot, rank: float, min_compression_rate: float) -> tuple[int, int] | None:
    """``(n, m)`` (first dimension by the rest) of a compressed tensor; None when 1-D or failing
    PyTorch's hook's rule ``r (n + m) * min_compression_rate < n m``."""
    if len(slot.shape) < 2 or slot.numel == 0:
        return None
    n = slot.shape[0]
    m = slot.numel // n
    return (n, m) if matrix_rank(rank, n, m) * (n + m) * min_compression_rate < n * m else None


def _equal_runs(offsets: list[int]) -> list[tuple[int, int, int]]:
    """Cut ascending ``offsets`` into maximal runs of equal spacing: (first, stride, count)."""
    runs: list[list[int]] = []
    for off in offsets:
        run = runs[-1] if runs else None
        if run is not None and (len(run) == 1 or off - run[-1] == run[1] - run[0]):
            run.append(off)
        else:
            runs.append([off])
    return [(r[0], r[1] - r[0] if len(r) > 1 else 0, len(r)) for r in runs]


def _split(flat: torch.Tensor, shapes: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    out, pos = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat.narrow(0, pos, size).view(shape))
        pos += size
    return out
