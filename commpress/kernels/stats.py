"""Per-tensor statistics of a bucket in one pass: the largest magnitude and the sum of squares.

TernGrad needs both for every tensor of a bucket (its scale is max|g|, its clip bound a
multiple of the root mean square). One pass over the bucket reads each element once,
where ``aminmax`` and a norm per tensor read it twice; and the sum is defined to the bit,
so the CPU and CUDA kernels agree.

The order of the sum: a tensor of ``n`` elements is cut into chunks of
``STATS_ROWS x STATS_LANES`` elements (rows of ``STATS_LANES``, the last ones short);
in float64, lane ``j`` of a chunk sums element ``j`` of its rows in row order, lane ``j``
of the tensor sums its chunks' lanes in chunk order, and the total sums the lanes in lane
order. Squares of float32 values are exact in float64 and no sum of them can overflow, so
the total is finite exactly when the tensor is. The largest magnitude is order-free: the
maximum of ``bits & 0x7FFFFFFF`` over the elements, as a float32 (NaN if the tensor holds
one: a NaN's bits exceed +inf's). A NaN's payload is not specified: CUDA's conversions and
arithmetic return their own canonical NaN, the CPU's keep the input's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _checks
from .cuda import _launch

__all__ = ["span_stats"]


def span_stats(x: torch.Tensor, spans: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """For every span ``(offset, numel)`` of the flat buffer ``x``: its largest magnitude
    (float32[T], NaN if it holds one) and its sum of squares (float64[T], in the order the
    module describes), on ``x``'s device.

    ``x`` may be float32, float16 or bfloat16 (whose values float32 holds exactly).
    """
    offsets, lengths = _checks.check_bucket("x", x, spans)
    if x.is_cuda:
        return _launch.span_stats(x, offsets, lengths)
    from .cpu import stats

    peak, sumsq = stats.span_stats(x, offsets, lengths)
    return torch.from_numpy(peak), torch.from_numpy(sumsq)
