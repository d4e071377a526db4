"""Per-tensor statistics of a bucket in one pass: the largest magnitude and the sum of squares.

TernGrad needs both per tensor (its scale is max|g|, its clip bound a multiple of the RMS). The sum
is defined to the bit, so CPU and CUDA agree: a tensor is cut into chunks of ``STATS_ROWS`` rows of
``STATS_LANES`` elements; in float64, lane ``j`` of a chunk sums element ``j`` of its rows in order,
the tensor's lane ``j`` its chunks' lanes in order, and the total the lanes in order. Squares of
float32 values are exact in float64 and cannot overflow, so the total is finite exactly when the
tensor is. The largest magnitude is the maximum of ``bits & 0x7FFFFFFF`` as a float32 (NaN if the
tensor holds one; its payload is unspecified: CUDA's canonical NaN, or the CPU's input NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _checks
from .cuda import _launch

__all__ = ["span_stats"]


def span_stats(x: torch.Tensor, spans: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """For every span ``(offset, numel)`` of flat ``x``: its largest magnitude (float32[T]) and sum
    of squares (float64[T]), on ``x``'s device."""
    offsets, lengths = _checks.check_bucket("x", x, spans)
    if x.is_cuda:
        return _launch.span_stats(x, offsets, lengths)
    from .cpu import stats

    peak, sumsq = stats.span_stats(x, offsets, lengths)
    return torch.from_numpy(peak), torch.from_numpy(sumsq)
