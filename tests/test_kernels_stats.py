"""``span_stats``: every tensor's largest magnitude and sum of squares, in one pass.

The sum has a defined order (chunks of rows x lanes, in float64), so the compiled kernel and
the oracle give the same bits; both are checked against exact references: the largest
magnitude against ``abs().max()``, the sum against ``math.fsum`` (correctly rounded). A
float64 sum of at most ``n`` non-negative terms is within ``n * 2**-53`` of the exact sum,
relatively; the tensors here hold at most 70,000 elements, so 1e-11 bounds the difference.
"""

import math

import kernel_oracle
import numpy as np
import pytest
import torch

import commpress.kernels as cc
from commpress.kernels._constants import STATS_LANES, STATS_ROWS

CHUNK = STATS_LANES * STATS_ROWS
# around a row and a chunk, several chunks, and empty and tiny tensors
LENGTHS = [0, 1, 7, STATS_LANES - 1, STATS_LANES, STATS_LANES + 1, CHUNK - 1, CHUNK, CHUNK + 1, 4 * CHUNK + 77]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def bucket(dtype: torch.dtype, seed: int = 0, lead: int = 3) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A flat buffer holding a tensor of every length in LENGTHS (after ``lead`` unused elements)."""
    g = torch.Generator().manual_seed(seed)
    spans, offset = [], lead
    for n in LENGTHS:
        spans.append((offset, n))
        offset += n
    x = (torch.randn(offset, generator=g) * torch.logspace(-3, 2, offset)).to(dtype)
    return x, spans


@pytest.fixture(params=["kernels", "oracle"])
def ops(request):
    return cc if request.param == "kernels" else kernel_oracle


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_peak_and_sum_within_float64_rounding(ops, threads, dtype):
    x, spans = bucket(dtype)
    peak, sumsq = ops.span_stats(x, spans)
    assert peak.dtype == torch.float32 and sumsq.dtype == torch.float64 and peak.shape == sumsq.shape == (len(spans),)
    for t, (o, n) in enumerate(spans):
        values = x[o : o + n].double()
        assert peak[t].item() == (values.abs().max().item() if n else 0.0)
        exact = math.fsum(v * v for v in values.tolist())  # squares of float32 values are exact in float64
        assert abs(sumsq[t].item() - exact) <= 1e-11 * exact


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_and_oracle_give_the_same_bits(both, threads, dtype):
    x, spans = bucket(dtype, seed=1)
    x[spans[8][0] + 5] = float("inf")  # a tensor with an Inf, one with a NaN, one with -0.0
    x[spans[9][0] + CHUNK + 3] = float("nan")
    x[spans[2][0]] = -0.0
    (peak_a, sum_a), (peak_b, sum_b) = both(lambda ops: ops.span_stats(x, spans))
    assert torch.equal(peak_a.view(torch.int32), peak_b.view(torch.int32))
    assert torch.equal(sum_a.view(torch.int64), sum_b.view(torch.int64))
    # a non-finite tensor has a non-finite sum (NaN wins the peak too), the others stay finite
    assert torch.isinf(peak_a[8]) and torch.isinf(sum_a[8]) and torch.isnan(peak_a[9]) and torch.isnan(sum_a[9])
    assert torch.isfinite(sum_a[:8]).all()


def test_the_documented_order(both):
    """The kernels sum exactly as the module says: rows, then chunks, then lanes, in order.

    Lane 0 is built so that the order of its chunks shows in the bits: chunk 0 holds a square of
    2**60 (where a float64's spacing is 256), chunks 1-3 a square of 100 each. In order, each 100
    is under half a spacing and is lost; in reverse, the three add up to 300 first and round to
    2**60 + 256. Every other lane holds noise of small squares, which shifts both totals alike."""
    n = 3 * CHUNK + 1000
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g).numpy()
    x[np.arange(0, n, STATS_LANES)] = 0.0  # lane 0: only the built values below
    x[0], x[CHUNK], x[2 * CHUNK], x[3 * CHUNK] = 2.0**30, 10.0, 10.0, 10.0
    squares = np.zeros(4 * CHUNK)
    squares[:n] = x.astype(np.float64) ** 2

    def total(chunk_order):
        lanes = [0.0] * STATS_LANES
        for c in chunk_order:
            for j in range(STATS_LANES):
                part = 0.0
                for r in range(STATS_ROWS):
                    part += squares[c * CHUNK + r * STATS_LANES + j]
                lanes[j] += part
        out = 0.0
        for v in lanes:
            out += v
        return out

    assert total([3, 2, 1, 0]) != total([0, 1, 2, 3])
    for sumsq in both(lambda ops: ops.span_stats(torch.from_numpy(x), [(0, n)])[1].item()):
        assert sumsq == total([0, 1, 2, 3])


def test_large_values_do_not_overflow():
    x = torch.full((1000,), torch.finfo(torch.float32).max)
    peak, sumsq = cc.span_stats(x, [(0, 1000)])
    assert peak.item() == torch.finfo(torch.float32).max and math.isfinite(sumsq.item())


def test_bad_input():
    x = torch.zeros(100)
    with pytest.raises(ValueError, match=r"span \(90, 20\) is not inside the 100 elements"):
        cc.span_stats(x, [(0, 10), (90, 20)])
    with pytest.raises(ValueError, match="expected \\(offset, length\\) pairs of integers"):
        cc.span_stats(x, [(0, 1.5)])
    with pytest.raises(ValueError, match="flat contiguous"):
        cc.span_stats(torch.zeros(10, 10), [(0, 10)])
    with pytest.raises(TypeError, match="accepted dtypes"):
        cc.span_stats(torch.zeros(10, dtype=torch.int32), [(0, 10)])
