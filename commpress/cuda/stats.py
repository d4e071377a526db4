"""Per-tensor statistics of a bucket in one pass: the largest magnitude and the sum of squares.

TernGrad needs both for every tensor of a bucket (its scale is max|g|, its clip bound a
multiple of the root mean square). One pass over the bucket reads each element once,
where ``aminmax`` and a norm per tensor read it twice; and the sum is defined to the bit,
so the CPU paths and the CUDA kernels agree.

The order of the sum: a tensor of ``n`` elements is cut into chunks of
``STATS_ROWS x STATS_LANES`` elements (rows of ``STATS_LANES``, the last ones short);
in float64, lane ``j`` of a chunk sums element ``j`` of its rows in row order, lane ``j``
of the tensor sums its chunks' lanes in chunk order, and the total sums the lanes in lane
order. Squares of float32 values are exact in float64 and no sum of them can overflow, so
the total is finite exactly when the tensor is. The largest magnitude is order-free: the
maximum of ``bits & 0x7FFFFFFF`` over the elements, as a float32 (NaN if the tensor holds
one: a NaN's bits exceed +inf's).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _backend, _checks, _chunks
from ._constants import STATS_LANES, STATS_ROWS

__all__ = ["span_stats"]

_CHUNK = STATS_LANES * STATS_ROWS


def _stats_np(x: np.ndarray) -> tuple[np.uint32, np.float64]:
    """The numpy path for one float32 tensor: (peak bits, sum of squares), in the documented order."""
    n = x.size
    if n == 0:
        return np.uint32(0), np.float64(0.0)
    peak = np.max(x.view(np.uint32) & np.uint32(0x7FFFFFFF))
    squares = np.zeros(-(-n // _CHUNK) * _CHUNK, np.float64)  # padding adds +0.0: no change to a sum >= 0
    np.square(x, out=squares[:n], dtype=np.float64)
    chunks = np.add.reduce(squares.reshape(-1, STATS_ROWS, STATS_LANES), axis=1)  # rows in order (not the fast axis)
    lanes = np.add.reduce(chunks, axis=0)  # chunks in order
    return peak, np.cumsum(lanes)[-1]  # lanes in order


def span_stats(x: torch.Tensor, spans: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """For every span ``(offset, numel)`` of the flat buffer ``x``: its largest magnitude
    (float32[T], NaN if it holds one) and its sum of squares (float64[T], in the order the
    module describes), on ``x``'s device.

    ``x`` may be float32, float16 or bfloat16 (whose values float32 holds exactly).
    """
    _checks.check_float("x", x)
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"x must be a flat contiguous buffer, got shape {tuple(x.shape)}")
    offsets, lengths = _chunks.check_spans(spans, x.numel())
    if x.is_cuda:
        from . import _launch

        return _launch.span_stats(x, offsets, lengths)
    kernels = _backend.compiled()
    if kernels is not None:
        peak, sumsq = kernels.span_stats(x, offsets, lengths)
    else:
        src = _chunks.as_numpy(x if x.dtype == torch.float32 else x.float())
        found = [_stats_np(src[o : o + n]) for o, n in zip(offsets.tolist(), lengths.tolist())]
        peak = np.array([f[0] for f in found], np.uint32).view(np.float32)
        sumsq = np.array([f[1] for f in found], np.float64)
    return torch.from_numpy(peak), torch.from_numpy(sumsq)
