"""Span statistics on the CPU (numba): every tensor's largest magnitude and sum of squares in one pass."""

from __future__ import annotations

import numpy as np
import torch

from commpress.kernels._constants import STATS_LANES, STATS_ROWS

from . import _chunks
from ._jit import KEY_ABS, inline, jit

__all__ = ["span_stats"]


@inline
def _stats_row(xs, bs, part, top):
    """Add a row's squares to ``part`` and its magnitudes' bits to ``top`` (a full row vectorizes)."""
    if xs.size == STATS_LANES:
        for j in range(STATS_LANES):
            v = np.float64(xs[j])
            part[j] += v * v
            top[j] = max(top[j], bs[j] & KEY_ABS)
    else:
        for j in range(xs.size):
            v = np.float64(xs[j])
            part[j] += v * v
            top[j] = max(top[j], bs[j] & KEY_ABS)


@jit
def span_stats_items(x, xbits, offsets, lengths, items, peak, sumsq):
    """Per tensor of ``items``: the largest magnitude's bits into ``peak`` (ordered like the floats; a
    NaN's win) and the sum of squares into ``sumsq``, in :mod:`commpress.kernels.stats`' order."""
    lanes = np.empty(STATS_LANES, np.float64)
    part = np.empty(STATS_LANES, np.float64)
    top = np.empty(STATS_LANES, np.uint32)
    for t in items:
        a, n = offsets[t], lengths[t]
        lanes[:] = 0.0
        top[:] = 0
        for cs in range(0, n, STATS_LANES * STATS_ROWS):
            ce = min(n, cs + STATS_LANES * STATS_ROWS)
            part[:] = 0.0
            for rs in range(a + cs, a + ce, STATS_LANES):
                _stats_row(x[rs : min(rs + STATS_LANES, a + ce)], xbits[rs : rs + STATS_LANES], part, top)
            for j in range(STATS_LANES):
                lanes[j] += part[j]
        total = 0.0
        high = np.uint32(0)
        for j in range(STATS_LANES):
            total += lanes[j]
            high = max(high, top[j])
        sumsq[t] = total
        peak[t] = high


def span_stats(x: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(peak float32[T], sum of squares float64[T]) of the segments, whole ones per thread."""
    src = _chunks.as_numpy(x.float())
    peak, sumsq = np.zeros(offsets.size, np.uint32), np.zeros(offsets.size, np.float64)
    run = lambda items: span_stats_items(src, src.view(np.uint32), offsets, lengths, items, peak, sumsq)  # noqa: E731
    _chunks.map_blocks(run, [(items,) for items in _chunks.whole_segments(lengths)])
    return peak.view(np.float32), sumsq
