"""TernGrad's ternary codes on the CPU (numba): quantize and pack, decode and sum the ranks."""

from __future__ import annotations

import numpy as np
import torch

from . import _chunks
from ._jit import ONE, PIECE, ZERO, inline, jit
from .bitpack import pack_fixed
from .rng import unit_pairs

__all__ = [
    "ternary_quantize_pack",
    "ternary_quantize_pack_many",
    "ternary_unpack_accumulate",
    "ternary_unpack_accumulate_many",
]


@inline
def _ternary_codes(x, xbits, ones, scale, bound, codes):
    """1 (keep, +), 2 (keep, -) or 0: keep iff ``ones - 1 < min(|x|, bound) / scale`` (NaN: never)."""
    for t in range(x.size):
        a = abs(x[t])
        a = bound if a > bound else a
        keep = np.uint32((ones[t] - ONE) < a / scale)
        codes[t] = np.uint8(keep + (keep & (xbits[t] >> np.uint32(31))))  # 1 + sign when kept: in 32-bit lanes


@jit
def ternary_pack(x, xbits, scale, bound, seed, first, out):
    """Codes of float32 ``x`` (elements ``first ..``, ``first % 4 == 0``) packed 4 per byte into ``out``."""
    m = x.size
    ones = np.empty(PIECE, np.float32)
    words = ones.view(np.uint64)
    codes = np.empty(PIECE, np.uint8)
    for ps in range(0, m, PIECE):
        pe = min(m, ps + PIECE)
        count = pe - ps
        unit_pairs(seed, np.uint64((first + ps) >> 1), words[: (count + 1) >> 1])
        _ternary_codes(x[ps:pe], xbits[ps:pe], ones[:count], scale, bound, codes[:count])
        pack_fixed(codes[:count], out[ps >> 2 : (pe + 3) >> 2], 4, 2)


@jit
def ternary_pack_items(x, scales, bounds, seeds, x_at, out_at, item_segment, item_start, item_stop, out):
    """:func:`ternary_pack` for items ``(segment t, start, stop)``: tensor ``t`` is ``x[x_at[t]:]``,
    its bytes ``out[out_at[t]:]``; a scale that is not > 0 gives zero codes."""
    xbits = x.view(np.uint32)
    for i in range(item_segment.size):
        t, s, e = item_segment[i], item_start[i], item_stop[i]
        dst = out[out_at[t] + (s >> 2) : out_at[t] + ((e + 3) >> 2)]
        if scales[t] > ZERO:
            a, b = x_at[t] + s, x_at[t] + e
            ternary_pack(x[a:b], xbits[a:b], scales[t], bounds[t], seeds[t], s, dst)
        else:
            dst[:] = 0


@inline
def ranks_average(part, world, stride, div, out):
    """``out[i]`` = ``part[i] + part[stride + i] + ...`` (``world`` rows, in rank order), / ``div``
    if ``world > 1``; row 0 of ``part`` is overwritten with the sum."""
    n = out.size
    acc = part[:n]
    for r in range(1, world):
        row = part[r * stride : r * stride + n]
        for i in range(n):
            acc[i] += row[i]
    if world > 1:
        for i in range(n):
            out[i] = acc[i] / div
    else:
        for i in range(n):
            out[i] = acc[i]


@jit
def ternary_decode(packed, scales, first, out):
    """``out[i]`` = rank-order sum of ``scales[r] * code_r(first + i)``, / world if > 1 (``first % 4 == 0``);
    a byte becomes its four values by one 16-byte table copy, then the rows are summed in vector loops."""
    world = packed.shape[0]
    div = np.float32(world)
    value = np.zeros((world, 4), np.float32)  # code -> value, per rank
    for r in range(world):
        value[r, 1] = scales[r]
        value[r, 2] = -scales[r]
    table = np.empty(world * 256 * 4, np.float32)  # (rank, byte) -> the byte's four values
    for r in range(world):
        for y in range(256):
            for t in range(4):
                table[(r * 256 + y) * 4 + t] = value[r, (y >> (2 * t)) & 3]
    rows = table.view(np.complex128)  # one byte's four float32 values as one 16-byte item
    part = np.empty(world * PIECE, np.float32)  # the piece's values, one row per rank
    items = part.view(np.complex128)
    per = PIECE >> 2
    base = first >> 2
    m = out.size
    whole = m >> 2
    for bs in range(0, whole, per):
        be = min(whole, bs + per)
        for r in range(world):
            src = packed[r, base + bs : base + be]
            dst = items[r * per : r * per + be - bs]
            tab = rows[r * 256 : r * 256 + 256]
            for b in range(src.size):
                dst[b] = tab[src[b]]
        ranks_average(part, world, PIECE, div, out[4 * bs : 4 * be])
    for i in range(m & ~3, m):
        shift = (i & 3) * 2
        acc = value[0, (packed[0, base + (i >> 2)] >> shift) & 3]
        for r in range(1, world):
            acc += value[r, (packed[r, base + (i >> 2)] >> shift) & 3]
        out[i] = acc / div if world > 1 else acc


@jit
def ternary_decode_items(packed, scales, packed_at, out_at, item_segment, item_start, item_stop, out):
    """:func:`ternary_decode` for items: tensor ``t``'s payloads start at column ``packed_at[t]``,
    its scales are ``scales[t]``, its elements ``out[out_at[t]:]``."""
    for i in range(item_segment.size):
        t, s, e = item_segment[i], item_start[i], item_stop[i]
        ternary_decode(packed[:, packed_at[t] :], scales[t], s, out[out_at[t] + s : out_at[t] + e])


def ternary_quantize_pack(x: torch.Tensor, scale: float, bound: float, seed: int, out: torch.Tensor) -> None:
    """Fill ``out`` (uint8[ceil(n/4)]) with the packed ternary codes of contiguous ``x``."""
    dst = _chunks.as_numpy(out)
    s, b, seed64 = np.float32(scale), np.float32(bound), np.uint64(seed)

    def body(start: int, stop: int) -> None:
        for first, block in _chunks.float32_pieces(x, start, stop):
            ternary_pack(block, block.view(np.uint32), s, b, seed64, first, dst[first >> 2 :])

    _chunks.map_blocks(body, _chunks.parts(x.numel(), 4))


def ternary_unpack_accumulate(packed: torch.Tensor, scales: torch.Tensor, n: int, out: torch.Tensor) -> None:
    src, sc = _chunks.as_numpy(packed), _chunks.as_numpy(scales)
    flat = out.view(-1)
    fill = lambda first, block: ternary_decode(src, sc, first, block)  # noqa: E731
    _chunks.map_blocks(lambda s, e: _chunks.float32_out(flat, s, e, fill), _chunks.parts(n, 4))


def ternary_quantize_pack_many(
    x: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, scales: np.ndarray, bounds: np.ndarray, seeds: np.ndarray
) -> torch.Tensor:
    """The packed codes of the segments ``x[offsets[t] : offsets[t] + lengths[t]]``, end to end."""
    nbytes = (lengths + 3) // 4
    out_at = np.cumsum(nbytes) - nbytes
    out = torch.empty(int(nbytes.sum()), dtype=torch.uint8)
    src, dst = _chunks.as_numpy(x.float()), _chunks.as_numpy(out)
    items = _chunks.segment_items(lengths, 4)
    _chunks.map_blocks(lambda *item: ternary_pack_items(src, scales, bounds, seeds, offsets, out_at, *item, dst), items)
    return out


def ternary_unpack_accumulate_many(
    packed: torch.Tensor, scales: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, out: torch.Tensor
) -> None:
    """Decode every segment's payloads into ``out[offsets[t]:]``."""
    nbytes = (lengths + 3) // 4
    packed_at = np.cumsum(nbytes) - nbytes
    flat = out.view(-1)
    acc = flat.float()  # flat itself for float32
    src, sc, dst = _chunks.as_numpy(packed), _chunks.as_numpy(scales.t().contiguous()), _chunks.as_numpy(acc)
    items = _chunks.segment_items(lengths, 4)
    _chunks.map_blocks(lambda *item: ternary_decode_items(src, sc, packed_at, offsets, *item, dst), items)
    if acc is not flat:
        flat.copy_(acc)
