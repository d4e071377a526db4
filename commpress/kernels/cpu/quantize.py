"""b-bit bucket quantization on the CPU (numba): stochastic rounding per bucket, decode and sum the ranks."""

from __future__ import annotations

import numpy as np
import torch

from commpress.kernels._constants import packed_size

from . import _chunks
from ._jit import PIECE, ZERO, inline, jit
from .bitpack import pack
from .rng import fill_uniform

__all__ = ["quantize_pack", "unpack_accumulate"]


@jit
def _bucket_range(x, start, stop):
    """``(min, max)`` of non-empty float32 ``x[start:stop]``, both NaN if it holds one; eight lanes
    so the compare-and-select chains overlap and vectorize (the caller's ``+ 0.0`` settles zeros)."""
    lo = np.full(8, x[start], np.float32)
    hi = np.full(8, x[start], np.float32)
    nans = 0
    full = start + (stop - start) // 8 * 8
    for i in range(start, full, 8):
        for t in range(8):
            v = x[i + t]
            nans += v != v
            lo[t] = v if v < lo[t] else lo[t]
            hi[t] = v if v > hi[t] else hi[t]
    for i in range(full, stop):
        v = x[i]
        nans += v != v
        lo[0] = v if v < lo[0] else lo[0]
        hi[0] = v if v > hi[0] else hi[0]
    if nans:
        return np.float32(np.nan), np.float32(np.nan)
    a, b = lo[0], hi[0]
    for t in range(1, 8):
        a = lo[t] if lo[t] < a else a
        b = hi[t] if hi[t] > b else b
    return a, b


@inline
def _encode(x, u, lo, sc, top, codes):
    for t in range(x.size):
        q = (x[t] - lo) / sc
        q = q + u[t]
        q = q if q > ZERO else ZERO  # NaN -> 0
        q = q if q < top else top
        codes[t] = np.uint8(q)


@jit
def quantize(x, levels, bits, bucket_size, seed, first, mins, scales, out):
    """Codes, minima and scales of float32 ``x``, elements ``first ..`` of the tensor (``first`` starts
    a bucket on a byte boundary); ``mins``, ``scales`` and ``out`` are this span's buckets and bytes."""
    m = x.size
    u = np.empty(PIECE, np.float32)
    codes = np.empty(PIECE, np.uint8)
    top = np.float32(levels)
    bucket = -1  # the bucket whose (lo, scale) are in hand
    lo = ZERO
    sc = ZERO
    for ps in range(0, m, PIECE):
        pe = min(m, ps + PIECE)
        fill_uniform(u[: pe - ps], seed, first + ps)
        i = ps
        while i < pe:
            j = i // bucket_size
            if j != bucket:  # first element of bucket j: its min and max
                bucket = j
                a, b = _bucket_range(x, j * bucket_size, min(m, (j + 1) * bucket_size))
                lo = a + ZERO  # a zero minimum is +0
                sc = ((b + ZERO) - lo) / top
                mins[j] = lo
                scales[j] = sc
            stop = min(pe, (j + 1) * bucket_size)
            if sc == ZERO:
                codes[i - ps : stop - ps] = 0
            else:
                _encode(x[i:stop], u[i - ps : stop - ps], lo, sc, top, codes[i - ps : stop - ps])
            i = stop
        pack(codes[: pe - ps], bits, out[(ps * bits) >> 3 :])


@inline
def _decode_first(codes, sc, lo, out):
    for t in range(out.size):
        out[t] = codes[t] * sc + lo


@inline
def _decode_add(codes, sc, lo, out):
    for t in range(out.size):
        out[t] = out[t] + (codes[t] * sc + lo)


@inline
def _divide(out, div):
    for t in range(out.size):
        out[t] = out[t] / div


@inline
def _codes_of_bytes(packed, table, codes, per):
    for b in range(packed.size):
        y = packed[b]
        for t in range(per):
            codes[b * per + t] = table[y, t]


@jit
def dequantize_accumulate(packed, mins, scales, bits, bucket_size, first, average, out):
    """``out[i]`` = sum over ranks (in order) of ``lo + q * scale`` of element ``first + i``
    (``first * bits`` a multiple of 8), divided by the world when ``average``."""
    world = packed.shape[0]
    div = np.float32(world)
    per = 8 // bits
    mask = (1 << bits) - 1
    table = np.empty((256, per), np.float32)  # byte -> its codes as floats
    for y in range(256):
        for t in range(per):
            table[y, t] = (y >> (t * bits)) & mask
    codes = np.empty(PIECE, np.float32)
    m = out.size
    for ps in range(0, m, PIECE):  # all ranks over one piece of out, kept in cache
        pe = min(m, ps + PIECE)
        byte0 = ((first + ps) * bits) >> 3
        nbytes = (pe - ps + per - 1) // per
        for r in range(world):
            if bits == 2:
                _codes_of_bytes(packed[r, byte0 : byte0 + nbytes], table, codes, 4)
            elif bits == 4:
                _codes_of_bytes(packed[r, byte0 : byte0 + nbytes], table, codes, 2)
            else:
                _codes_of_bytes(packed[r, byte0 : byte0 + nbytes], table, codes, 1)
            i = ps
            while i < pe:
                j = (first + i) // bucket_size
                stop = min(pe, (j + 1) * bucket_size - first)
                lo = mins[r, j]
                sc = scales[r, j]
                if r == 0:
                    _decode_first(codes[i - ps : stop - ps], sc, lo, out[i:stop])
                else:
                    _decode_add(codes[i - ps : stop - ps], sc, lo, out[i:stop])
                i = stop
        if average and world > 1:
            _divide(out[ps:pe], div)


def quantize_pack(x: torch.Tensor, bits: int, bucket_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, mins, scales)`` of contiguous ``x``: uint8[ceil(n*bits/8)] and float32[ceil(n / bucket_size)] twice."""
    n = x.numel()
    nb = -(-n // bucket_size)
    packed = torch.empty(packed_size(n, bits), dtype=torch.uint8)
    mins, scales = torch.empty(nb, dtype=torch.float32), torch.empty(nb, dtype=torch.float32)
    dst, mins_np, scales_np = _chunks.as_numpy(packed), _chunks.as_numpy(mins), _chunks.as_numpy(scales)
    levels, seed64 = (1 << bits) - 1, np.uint64(seed)
    align = bucket_size * (8 // np.gcd(bucket_size * bits, 8))  # spans start on a bucket and a byte

    def body(start: int, stop: int) -> None:
        block = _chunks.float32_block(x, start, stop)
        j = start // bucket_size
        quantize(block, levels, bits, bucket_size, seed64, start, mins_np[j:], scales_np[j:], dst[start * bits // 8 :])

    _chunks.map_blocks(body, _chunks.parts(n, int(align)))
    return packed, mins, scales


def unpack_accumulate(
    packed: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    bucket_size: int,
    n: int,
    out: torch.Tensor,
    average: bool,
) -> None:
    src, mins_np, scales_np = (_chunks.as_numpy(t) for t in (packed, mins, scales))
    flat = out.view(-1)
    fill = lambda first, block: dequantize_accumulate(src, mins_np, scales_np, bits, bucket_size, first, average, block)  # noqa: E731
    _chunks.map_blocks(lambda s, e: _chunks.float32_out(flat, s, e, fill), _chunks.parts(n, 8))
