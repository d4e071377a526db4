"""What the error models of a layer-wise plan read off one tensor, computed once for all of them.

Many settings' models (:meth:`~commpress.compressors.base.Compressor.error_model`) read the same
statistics: squares and their sum, sums of the largest squares (every Top-k density), the top
singular values (every rank). Models ask up front for the counts and rank they will read
(:meth:`TensorStats.want_top`, :meth:`TensorStats.want_rank`), so one pass serves them all.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import torch

__all__ = ["TensorStats", "runs", "top_singular", "top_sums"]


class TensorStats:
    """One tensor (``whole``, flat) and the ``rows`` its errors are measured on (all, or a strided sample);
    ``factor`` scales their errors to the tensor's, ``whole_energy`` is a sample's tensor energy."""

    def __init__(
        self, whole: torch.Tensor, shape: tuple[int, ...], rows: torch.Tensor, factor: float, whole_energy: float | None
    ) -> None:
        self.whole, self.shape, self.rows, self.factor = whole, shape, rows, factor
        self._whole_energy = whole_energy
        self._counts: set[int] = set()
        self._rank = 0
        self._singular: dict[tuple[int, int], torch.Tensor] = {}

    def want_top(self, k: int) -> None:
        """A model will read :meth:`top_kept` of ``k`` (ask before any model reads)."""
        self._counts.add(k)

    def want_rank(self, rank: int) -> None:
        """A model will read :meth:`singular` values up to ``rank`` (ask before any model reads)."""
        self._rank = max(self._rank, rank)

    @property
    def numel(self) -> int:
        """The tensor's elements (the measured rows may be fewer)."""
        return self.whole.numel()

    @functools.cached_property
    def double(self) -> torch.Tensor:
        """The measured rows in float64."""
        return self.rows.to(torch.float64)

    @functools.cached_property
    def squares(self) -> torch.Tensor:
        """The squares of the measured rows (float32, like the tensor)."""
        return self.rows.square()

    @functools.cached_property
    def energy(self) -> float:
        """The measured rows' energy, their squares summed in float64."""
        return float(self.squares.sum(dtype=torch.float64))

    @functools.cached_property
    def _kept(self) -> dict[int, float]:
        if not math.isfinite(self.energy):  # a non-finite step, discarded: nothing to search
            return dict.fromkeys(self._counts, self.energy)
        return top_sums(self.squares, self._counts)

    def top_kept(self, k: int) -> float:
        """What k entries of the measured rows send: the sum of their k largest squares."""
        return self._kept[k]

    @property
    def whole_energy(self) -> float:
        """The tensor's energy: the sample's finding, or the measured rows' when they are the tensor."""
        return self.energy if self._whole_energy is None else self._whole_energy

    def singular(self, n: int, m: int) -> torch.Tensor:
        """The largest singular values of the tensor as an n x m matrix (:func:`top_singular`)."""
        if (n, m) not in self._singular:
            self._singular[n, m] = top_singular(self.whole.view(n, m), self._rank)
        return self._singular[n, m]


def runs(acc: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``acc`` as rows of ``n`` elements, the last, shorter run as a row of its own."""
    whole = acc.numel() // n * n
    rows = [acc[:whole].view(-1, n)] if whole else []
    if whole < acc.numel():
        rows.append(acc[whole:].view(1, -1))
    return rows


#: :func:`top_singular` is exact up to a smaller side of this many times the rank, then iterates.
_EXACT_SIDE = 4
_POWER_STEPS = 2  # power iterations
_OVERSAMPLE = 8  # extra columns beyond the rank asked for


def top_singular(a: torch.Tensor, k: int) -> torch.Tensor:
    """At least ``k`` largest singular values of ``a`` in float64, largest first.

    Exact where the smaller side is small, else (cheaper on large matrices) the Ritz values of a block
    power iteration from a fixed start: never above the true values, so errors read off them are bounds."""
    n, m = a.shape
    if min(n, m) <= _EXACT_SIDE * max(k, 1):
        return torch.linalg.svdvals(a.to(torch.float64))
    a = a if n >= m else a.T  # tall: n >= m
    start = torch.Generator(device="cpu").manual_seed(0)
    basis = torch.randn(a.shape[1], k + _OVERSAMPLE, generator=start).to(a.device, a.dtype)
    y = torch.linalg.qr(a @ basis).Q
    for _ in range(_POWER_STEPS):
        y = torch.linalg.qr(a @ torch.linalg.qr(a.T @ y).Q).Q
    return torch.linalg.svdvals((y.T @ a).to(torch.float64))


def top_sums(values: torch.Tensor, counts: Iterable[int]) -> dict[int, float]:
    """For each k of ``counts``, the float64 sum of the k largest of ``values`` (flat, finite, >= 0): on
    the CPU by radix selection; on CUDA by a sort, fast and, unlike weighted bincounts, reproducible."""
    ks = sorted(set(counts))
    return _sorted_sums(values, ks) if values.is_cuda else _radix_sums(values, ks)


def _sorted_sums(values: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """:func:`top_sums` by definition: the cumulative sums of the values sorted, largest first."""
    kept = values.sort(descending=True).values.cumsum(0, dtype=torch.float64)
    return dict(zip(ks, kept[torch.tensor(ks, device=values.device) - 1].tolist()))


#: :func:`_radix_sums` bins a float32 by the exponent and top 4 mantissa bits (few bins to clear).
_RADIX_SHIFT = 19


def _radix_sums(values: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """:func:`top_sums` by radix selection: non-negative float32 bits order like integers, so one
    histogram (count and sum per bin) locates each k-th largest's bin; only those bins are sorted."""
    bins = values.view(torch.int32) >> _RADIX_SHIFT
    size = 1 << (31 - _RADIX_SHIFT)
    above = torch.bincount(bins, minlength=size).flip(0).cumsum(0)  # above[i]: entries in the top i + 1 bins
    sums = torch.bincount(bins, weights=values.double(), minlength=size).flip(0).cumsum(0)
    tops = torch.searchsorted(above, torch.tensor(ks)).tolist()  # the bin of each k-th largest, from the top
    boundary = torch.zeros(size, dtype=torch.bool)
    boundary[[size - 1 - i for i in tops]] = True
    where = boundary[bins].nonzero().squeeze(1)
    inside, inside_bins = values[where], bins[where]
    out = {}
    for k, i in zip(ks, tops):
        count, total = (int(above[i - 1]), float(sums[i - 1])) if i else (0, 0.0)
        rest = inside[inside_bins == size - 1 - i].sort(descending=True).values[: k - count]
        out[k] = total + float(rest.sum(dtype=torch.float64))
    return out
