"""How the low-rank compressors see a bucket: batches of same-shape matrices plus an
uncompressed ("dense") rest, and batched orthonormalization.

Speed comes from three choices. Same-shape matrices of a bucket usually sit at equally
spaced offsets (one per transformer block), so a batch is a strided 3-D *view* of the flat
buffer and one ``torch.bmm`` handles every layer of that shape, with no copy and no Python
loop over layers. The error buffer is double-buffered: ``M = grad + error`` is written into
the spare buffer, which then becomes the new error in place (``baddbmm_``), so error
feedback costs one write and keeps the old error intact until the step is committed. And
the factor ``Q`` is kept transposed (r x m), which makes ``Q = M^T P`` the fast
``P^T M`` product.

Per-parameter state (error, factors) is stored by name elsewhere (``memory``); a plan's
:attr:`LowRankPlan.factors` says where each compressed matrix sits in the bucket and in the
flat factor buffers, so a bucket can gather and stage its parameters' state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from commpress.compressors.base import ParamSlot

__all__ = ["Factor", "LowRankPlan", "MatrixBatch", "orthonormalize"]


def orthonormalize(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning (at least) the columns of every matrix in the batch
    ``x`` (count x n x r, r <= n).

    Householder QR, batched in one LAPACK call. Unlike Gram-Schmidt it needs no epsilon:
    a zero or rank-deficient input still gives orthonormal columns, because ``x = QR``
    puts the span of ``x`` inside the span of ``Q``.
    """
    return torch.linalg.qr(x).Q


@dataclass(frozen=True)
class MatrixBatch:
    """``count`` gradient matrices of shape n x m at offsets ``first + i * stride`` of a
    bucket's flat buffer, approximated at rank ``rank``."""

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
    """One compressed matrix: its slot, and where its blocks of the flat factor buffers
    start (``q``: r x m, transposed Q; ``p``: n x r)."""

    slot: ParamSlot
    n: int
    m: int
    rank: int
    q_offset: int
    p_offset: int


@dataclass(frozen=True, eq=False)
class LowRankPlan:
    """How one bucket is compressed: its matrix batches and the positions of the dense
    elements (1-D tensors and matrices that would not compress by ``min_compression_rate``),
    with its index tensor on ``device`` (the gradients' device)."""

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
                n, m = shape
                by_shape.setdefault((n, m), []).append(s.offset)
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
    """The rank an n x m matrix is approximated at: ``min(rank, n, m)`` for a whole number,
    and for a fraction in (0, 1) (Dion's) that share of ``min(n, m)``, at least 1."""
    if isinstance(rank, int):
        return min(rank, n, m)
    return max(1, int(rank * min(n, m)))


def matrix_shape(slot: ParamSlot, rank: float, min_compression_rate: float) -> tuple[int, int] | None:
    """``(n, m)`` of a tensor that is compressed as an n x m matrix (the first dimension by
    the rest), or None when it is sent uncompressed: 1-D, or not smaller at rank
    r = matrix_rank(rank, n, m) by PyTorch's hook's rule ``r (n + m) * min_compression_rate < n m``."""
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
