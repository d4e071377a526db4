"""Compiled CPU kernels (numba): each op is one fused pass over a span, no full-size temporaries.

The same arithmetic as the numpy path and the CUDA kernels, step for step: SplitMix64 on
uint64 words (wrapping multiplies), one IEEE float32 operation per step, no fast-math (so no
reassociation and no fused multiply-add). Every kernel releases the GIL and works on one span
(a few per thread, see ``_chunks.parts``), so torch's thread count sets the parallelism and
concurrent callers (gloo's callback threads) need no shared threading layer. Compiled on
first use and cached on disk (``cache=True``).

Importing this module imports numba: :mod:`._backend` does it only when the numba backend is
chosen.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

from . import _chunks
from ._constants import GAMMA, MIX1, MIX2, SEED_BASIS, STATS_LANES, STATS_ROWS, candidate_room, packed_size, sample_rank

__all__ = [
    "exact_threshold",
    "fill_uniform",
    "pack_bits",
    "quantize_pack",
    "sample_threshold",
    "scatter_add_decode",
    "select_candidates",
    "span_stats",
    "take_top",
    "take_top_many",
    "ternary_quantize_pack",
    "ternary_quantize_pack_many",
    "ternary_unpack_accumulate",
    "ternary_unpack_accumulate_many",
    "unpack_accumulate",
    "unpack_bits",
]


_GAMMA = np.uint64(GAMMA)
_MIX1 = np.uint64(MIX1)
_MIX2 = np.uint64(MIX2)
_BASIS = np.uint64(SEED_BASIS)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)
_M23 = np.uint64(0x7FFFFF)
_ULP23 = np.float32(2.0**-23)  # uniform = 23 random bits * 2**-23, exact in float32
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_M23X2 = np.uint64(0x007FFFFF007FFFFF)  # the low 23 bits of both halves of a word
_ONEX2 = np.uint64(0x3F8000003F800000)  # 1.0f in both halves
_KEY_INF = np.uint32(0x7F800000)  # +inf's bits: the largest top-k key (NaN is given it too)
_KEY_ABS = np.uint32(0x7FFFFFFF)
_LANES, _ROWS = STATS_LANES, STATS_ROWS
_NONE = np.empty(0, np.float32)  # "no residual" for the kernels that may add one
_PIECE = 4096  # elements per scratch piece (a multiple of 8: whole bytes at every bit width)

_jit = njit(nogil=True, cache=True, error_model="numpy")
_inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")
_sample_rank = _inline(sample_rank)  # the Python path's own arithmetic, compiled
_candidate_room = _inline(candidate_room)


# ---- random numbers -------------------------------------------------------------------


@_inline
def _mix(z):
    """SplitMix64's output function."""
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


@_inline
def _word(seed, c):
    """SplitMix64 word ``c`` (uint64) of stream ``seed``."""
    return _mix(seed + c * _GAMMA)


@_inline
def _unit(bits):
    """The uniform in [0, 1) built from the low 23 bits of a draw (uint64 holding the draw)."""
    return np.float32(bits & _M23) * _ULP23


@_inline
def _unit_pairs(seed, c, words):
    """``words[j]``: words ``c + j`` of stream ``seed`` as two float32 in [1, 2) (low draw
    first): the 23 bits of each draw under the exponent of 1.0, so ``value - 1`` is its
    uniform, exactly. The counter advances by addition (no multiply in the loop)."""
    z = seed + c * _GAMMA
    for j in range(words.size):
        words[j] = (_mix(z) & _M23X2) | _ONEX2
        z += _GAMMA


@_inline
def _words(seed, words):
    """``words[j]`` = word ``j`` of stream ``seed`` (on a little-endian machine its uint32 halves
    are draws ``2j`` and ``2j + 1``)."""
    z = seed
    for j in range(words.size):
        words[j] = _mix(z)
        z += _GAMMA


@_inline
def _minus_one(src, out):
    for t in range(out.size):
        out[t] = src[t] - _ONE


@_jit
def fill_uniform(out, seed, offset):
    """``out[i]`` = uniform ``offset + i`` of stream ``seed`` (float32 out, uint64 seed, int offset)."""
    m = out.size
    i = 0
    if m > 0 and offset & 1:
        out[0] = _unit(_word(seed, np.uint64(offset >> 1)) >> _S32)
        i = 1
    buf = np.empty(_PIECE, np.float32)
    words = buf.view(np.uint64)
    for ps in range(i, m, _PIECE):
        pe = min(m, ps + _PIECE)
        _unit_pairs(seed, np.uint64((offset + ps) >> 1), words[: (pe - ps + 1) >> 1])
        _minus_one(buf, out[ps:pe])


# ---- bit packing ----------------------------------------------------------------------


@_inline
def _pack_fixed(codes, out, per, bits):
    mask = (1 << bits) - 1
    n = codes.size
    full = n // per
    for b in range(full):
        v = 0
        for j in range(per):
            v |= (codes[b * per + j] & mask) << (j * bits)
        out[b] = v
    if full * per < n:
        v = 0
        for j in range(n - full * per):
            v |= (codes[full * per + j] & mask) << (j * bits)
        out[full] = v


@_jit
def pack(codes, bits, out):
    """Pack uint8 ``codes`` (any length) into ``out`` (``ceil(len * bits / 8)`` bytes)."""
    if bits == 1:
        _pack_fixed(codes, out, 8, 1)
    elif bits == 2:
        _pack_fixed(codes, out, 4, 2)
    elif bits == 4:
        _pack_fixed(codes, out, 2, 4)
    else:
        _pack_fixed(codes, out, 1, 8)


@_inline
def _unpack_fixed(packed, out, per, bits):
    mask = (1 << bits) - 1
    for i in range(out.size):
        out[i] = (packed[i // per] >> ((i % per) * bits)) & mask


@_jit
def unpack(packed, bits, out):
    """Unpack ``out.size`` codes from ``packed`` into uint8 ``out``."""
    if bits == 1:
        _unpack_fixed(packed, out, 8, 1)
    elif bits == 2:
        _unpack_fixed(packed, out, 4, 2)
    elif bits == 4:
        _unpack_fixed(packed, out, 2, 4)
    else:
        _unpack_fixed(packed, out, 1, 8)


# ---- TernGrad -------------------------------------------------------------------------


@_inline
def _ternary_codes(x, xbits, ones, scale, bound, codes):
    """1 (keep, +), 2 (keep, -) or 0: keep iff u < min(|x|, bound) / scale (NaN: never),
    with ``u = ones - 1``."""
    for t in range(x.size):
        a = abs(x[t])
        a = bound if a > bound else a
        keep = np.uint32((ones[t] - _ONE) < a / scale)
        codes[t] = np.uint8(keep + (keep & (xbits[t] >> np.uint32(31))))  # 1 + sign when kept: in 32-bit lanes


@_jit
def ternary_pack(x, xbits, scale, bound, seed, first, out):
    """Codes of float32 ``x`` (elements ``first ..``, ``first % 4 == 0``) packed 4 per byte
    into ``out``, a piece at a time: random words, codes, packing."""
    m = x.size
    ones = np.empty(_PIECE, np.float32)
    words = ones.view(np.uint64)
    codes = np.empty(_PIECE, np.uint8)
    for ps in range(0, m, _PIECE):
        pe = min(m, ps + _PIECE)
        count = pe - ps
        _unit_pairs(seed, np.uint64((first + ps) >> 1), words[: (count + 1) >> 1])
        _ternary_codes(x[ps:pe], xbits[ps:pe], ones[:count], scale, bound, codes[:count])
        _pack_fixed(codes[:count], out[ps >> 2 : (pe + 3) >> 2], 4, 2)


@_jit
def ternary_pack_items(x, scales, bounds, seeds, x_at, out_at, item_segment, item_start, item_stop, out):
    """:func:`ternary_pack` for items ``(segment t, start, stop)`` of several tensors: tensor
    ``t`` is ``x[x_at[t]:]`` with its own scale, bound and seed, its bytes ``out[out_at[t]:]``;
    a scale that is not > 0 gives zero codes."""
    xbits = x.view(np.uint32)
    for i in range(item_segment.size):
        t, s, e = item_segment[i], item_start[i], item_stop[i]
        dst = out[out_at[t] + (s >> 2) : out_at[t] + ((e + 3) >> 2)]
        if scales[t] > _ZERO:
            a, b = x_at[t] + s, x_at[t] + e
            ternary_pack(x[a:b], xbits[a:b], scales[t], bounds[t], seeds[t], s, dst)
        else:
            dst[:] = 0


@_inline
def _ranks_average(part, world, stride, div, out):
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


@_jit
def ternary_decode(packed, scales, first, out):
    """``out[i]`` = sum over ranks (in order) of ``scales[r] * code_r(first + i)``, / world if > 1
    (``first % 4 == 0``). A piece at a time: each rank's bytes become their four values by one
    16-byte table copy per byte, then the ranks' rows are summed in vector loops."""
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
    part = np.empty(world * _PIECE, np.float32)  # the piece's values, one row per rank
    items = part.view(np.complex128)
    per = _PIECE >> 2  # bytes per piece
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
        _ranks_average(part, world, _PIECE, div, out[4 * bs : 4 * be])
    for i in range(m & ~3, m):
        shift = (i & 3) * 2
        acc = value[0, (packed[0, base + (i >> 2)] >> shift) & 3]
        for r in range(1, world):
            acc += value[r, (packed[r, base + (i >> 2)] >> shift) & 3]
        out[i] = acc / div if world > 1 else acc


@_jit
def ternary_decode_items(packed, scales, packed_at, out_at, item_segment, item_start, item_stop, out):
    """:func:`ternary_decode` for items of several tensors: tensor ``t``'s payloads start at
    column ``packed_at[t]`` of ``packed``, its scales are ``scales[t]`` (one per rank), its
    elements ``out[out_at[t]:]``."""
    for i in range(item_segment.size):
        t, s, e = item_segment[i], item_start[i], item_stop[i]
        ternary_decode(packed[:, packed_at[t] :], scales[t], s, out[out_at[t] + s : out_at[t] + e])


# ---- span statistics --------------------------------------------------------------------


@_inline
def _stats_row(xs, bs, part, top):
    """Add a row's squares to the lanes ``part`` and its magnitudes' bits to ``top``; a full
    row is a loop of constant length (it vectorizes without a remainder)."""
    if xs.size == _LANES:
        for j in range(_LANES):
            v = np.float64(xs[j])
            part[j] += v * v
            top[j] = max(top[j], bs[j] & _KEY_ABS)
    else:
        for j in range(xs.size):
            v = np.float64(xs[j])
            part[j] += v * v
            top[j] = max(top[j], bs[j] & _KEY_ABS)


@_jit
def span_stats_items(x, xbits, offsets, lengths, items, peak, sumsq):
    """For the tensors ``items`` (tensor ``t`` is ``x[offsets[t]:][:lengths[t]]``, float32):
    the largest magnitude's bits into ``peak`` (uint32: for floats >= 0 the integer order is
    the float order and a NaN's bits exceed +inf's, so a NaN wins) and the sum of squares
    into ``sumsq`` (float64) in the order of ``stats.span_stats``. The lane loops are plain
    element-wise loops over small arrays, so they vectorize without reassociation."""
    lanes = np.empty(_LANES, np.float64)
    part = np.empty(_LANES, np.float64)
    top = np.empty(_LANES, np.uint32)
    for t in items:
        a, n = offsets[t], lengths[t]
        lanes[:] = 0.0
        top[:] = 0
        for cs in range(0, n, _LANES * _ROWS):
            ce = min(n, cs + _LANES * _ROWS)
            part[:] = 0.0
            for rs in range(a + cs, a + ce, _LANES):
                _stats_row(x[rs : min(rs + _LANES, a + ce)], xbits[rs : rs + _LANES], part, top)
            for j in range(_LANES):
                lanes[j] += part[j]
        total = 0.0
        high = np.uint32(0)
        for j in range(_LANES):
            total += lanes[j]
            high = max(high, top[j])
        sumsq[t] = total
        peak[t] = high


# ---- b-bit bucket quantization (QSDP) ---------------------------------------------------


@_jit
def _bucket_range(x, start, stop):
    """``(min, max)`` of float32 ``x[start:stop]`` (not empty), both NaN if it holds a NaN.

    Eight independent lanes, so the compare-and-select chains overlap (and vectorize); min
    and max do not depend on the order, and which zero comes out is settled by ``+ 0.0``.
    """
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


@_inline
def _encode(x, u, lo, sc, top, codes):
    for t in range(x.size):
        q = (x[t] - lo) / sc
        q = q + u[t]
        q = q if q > _ZERO else _ZERO  # NaN -> 0
        q = q if q < top else top
        codes[t] = np.uint8(q)


@_jit
def quantize(x, levels, bits, bucket_size, seed, first, mins, scales, out):
    """Codes, minima and scales of float32 ``x``: elements ``first ..`` of the tensor, where
    ``first`` starts a bucket on a byte boundary. ``mins``/``scales`` are this span's buckets,
    ``out`` its bytes."""
    m = x.size
    u = np.empty(_PIECE, np.float32)
    codes = np.empty(_PIECE, np.uint8)
    top = np.float32(levels)
    bucket = -1  # the bucket whose (lo, scale) are in hand
    lo = _ZERO
    sc = _ZERO
    for ps in range(0, m, _PIECE):
        pe = min(m, ps + _PIECE)
        fill_uniform(u[: pe - ps], seed, first + ps)
        i = ps
        while i < pe:
            j = i // bucket_size
            if j != bucket:  # first element of bucket j: its min and max
                bucket = j
                a, b = _bucket_range(x, j * bucket_size, min(m, (j + 1) * bucket_size))
                lo = a + _ZERO  # a zero minimum is +0
                sc = ((b + _ZERO) - lo) / top
                mins[j] = lo
                scales[j] = sc
            stop = min(pe, (j + 1) * bucket_size)
            if sc == _ZERO:
                codes[i - ps : stop - ps] = 0
            else:
                _encode(x[i:stop], u[i - ps : stop - ps], lo, sc, top, codes[i - ps : stop - ps])
            i = stop
        pack(codes[: pe - ps], bits, out[(ps * bits) >> 3 :])


@_inline
def _decode_first(codes, sc, lo, out):
    for t in range(out.size):
        out[t] = codes[t] * sc + lo


@_inline
def _decode_add(codes, sc, lo, out):
    for t in range(out.size):
        out[t] = out[t] + (codes[t] * sc + lo)


@_inline
def _divide(out, div):
    for t in range(out.size):
        out[t] = out[t] / div


@_inline
def _codes_of_bytes(packed, table, codes, per):
    for b in range(packed.size):
        y = packed[b]
        for t in range(per):
            codes[b * per + t] = table[y, t]


@_jit
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
    codes = np.empty(_PIECE, np.float32)
    m = out.size
    for ps in range(0, m, _PIECE):  # all ranks over one piece of out, kept in cache
        pe = min(m, ps + _PIECE)
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


# ---- top-k ----------------------------------------------------------------------------


@_inline
def _magnitude(v):
    """|v| with NaN as +inf (as ``topk._magnitudes``)."""
    a = abs(v)
    return a if a == a else np.float32(np.inf)


@_jit
def sampled_magnitudes(x, r, seed, sample):
    """Magnitudes (NaN as +inf) of ``sample`` entries of ``x`` (of ``x + r`` when ``r`` is not
    empty): entry ``j`` is ``floor(draw_j * n / 2**32)``, with draw ``j`` of stream ``seed``."""
    n = np.uint64(x.size)
    words = np.empty((sample + 1) >> 1, np.uint64)
    _words(seed, words)  # vectorized; the gather below is not
    draws = words.view(np.uint32)
    mags = np.empty(sample, np.float32)
    for j in range(sample):
        i = (np.uint64(draws[j]) * n) >> _S32
        mags[j] = _magnitude(x[i] + r[i] if r.size else x[i])
    return mags


@_inline
def _hits(flags, words, length, xs, base, count, cand, vals):
    """Append ``base + i`` and ``xs[i]`` for every set byte ``flags[i]`` of a piece of
    ``length`` elements to ``cand``/``vals`` while they have room (eight flags at a time: a
    word's set bytes give the hits); return the new count."""
    flags[length : (length + 7) // 8 * 8] = 0
    cap = cand.size
    for w in range((length + 7) // 8):
        v = words[w]
        while v:
            if count < cap:
                i = 8 * w + (np.int64(trailing_zeros(v)) >> 3)
                cand[count] = base + i
                vals[count] = xs[i]
            count += 1
            v &= v - np.uint64(1)
    return count


@_jit
def candidates(x, g, r, limit, first, cand, vals):
    """Write ``first + i`` and ``x[i]`` for each ``i`` with ``not |x[i]| < limit`` (NaN
    included) into ``cand`` and ``vals`` while they have room; return how many there are.
    With ``g`` not empty, ``x = g + r`` (float32) first, in the same pass.

    The test runs on the bits (for floats >= 0 the integer order is the float order, and a NaN's
    bits exceed +inf's), first as a byte flag per element over a piece (vectorized), then
    eight flags at a time as one word whose set bytes give the hits. The values are kept so
    the selection among the candidates never reads ``x`` again; the sum is tested while
    its piece is in cache, so it is not read back from memory.
    """
    xb = x.view(np.uint32)
    limit_bits = np.array([limit], np.float32).view(np.uint32)[0]
    count = 0
    flags = np.zeros(_PIECE, np.uint8)
    words = flags.view(np.uint64)
    for ps in range(0, x.size, _PIECE):
        pe = min(x.size, ps + _PIECE)
        xs, bits = x[ps:pe], xb[ps:pe]  # piece views: the loops vectorize
        if g.size:
            gs, rs = g[ps:pe], r[ps:pe]
            for i in range(pe - ps):
                xs[i] = gs[i] + rs[i]
        for i in range(pe - ps):
            flags[i] = (bits[i] & _KEY_ABS) >= limit_bits
        count = _hits(flags, words, pe - ps, xs, first + ps, count, cand, vals)
    return count


@_inline
def _key(bits):
    """A magnitude's order as an integer: |x|'s bits (for floats >= 0 the integer order is the
    float order), NaN given +inf's (as ``_magnitude``)."""
    a = bits & _KEY_ABS
    return a if a <= _KEY_INF else _KEY_INF


@_jit
def keys(x, out):
    """``out[i]`` = :func:`_key` of float32 ``x[i]``: its magnitude's order as an integer."""
    xb = x.view(np.uint32)
    for i in range(x.size):
        out[i] = _key(xb[i])


@_jit
def take_top_np(x, cand, vals, mags, kth, k, first, values, chosen):
    """Of ``cand`` (increasing indices into float32 ``x``, values ``vals``, magnitudes as the
    keys ``mags`` of :func:`_key`), the ``k`` with magnitude above ``kth`` and, to make up
    ``k``, the first ties at ``kth``: their values into ``values``, indices (+ ``first``)
    into ``chosen`` (int32), and zero them in ``x``."""
    need = k
    for j in range(cand.size):
        need -= mags[j] > kth  # what the ties must fill
    o = 0
    for j in range(cand.size):
        a = mags[j]
        if a > kth or (a == kth and need > 0):
            if not a > kth:
                need -= 1
            i = cand[j]
            values[o] = vals[j]
            chosen[o] = first + i
            x[i] = 0
            o += 1


@_jit
def kth_key(items, k):
    """The ``k``-th largest of the uint32 keys ``items`` (1 <= k <= size): a radix select over bits
    30-20, 19-9 and 8-0, each level counting only the keys that share the prefix found so far."""
    hist = np.empty(2048, np.int64)
    prefix = np.uint32(0)
    mask = np.uint32(0)
    for level in range(3):
        shift = np.uint32(20 if level == 0 else (9 if level == 1 else 0))
        bins = np.uint32(0x7FF if level < 2 else 0x1FF)
        hist[:] = 0
        for j in range(items.size):
            v = items[j]
            if v & mask == prefix:
                hist[(v >> shift) & bins] += 1
        b = np.int64(bins)
        while hist[b] < k:
            k -= hist[b]
            b -= 1
        prefix |= np.uint32(b) << shift
        mask |= bins << shift
    return prefix


@_inline
def _derive(seed, widen):
    """``rng.derive_seed(seed, widen)``."""
    h = _mix((_BASIS ^ seed) + _GAMMA)
    return _mix((h ^ np.uint64(widen)) + _GAMMA)


@_jit
def _top_of(x, g, r, first, k, sample, seed, slack, values, chosen):
    """``topk_select`` of one tensor ``x`` (float32, ``first`` its offset in the buffer, indices
    written as ``first + i``): a threshold (the k-th magnitude with ``sample`` = 0, else the
    sampled estimate, widened while it leaves fewer than k candidates), the candidates not
    below it, and of those the k largest, ties to the lower index; zeroed in ``x``. With
    ``g`` not empty, ``x = g + r`` is computed first (fused into the candidates' pass when
    the threshold is sampled)."""
    n = x.size
    fused = g.size > 0
    exact = sample == 0 or sample >= n or k == n
    if fused and exact:
        for i in range(n):
            x[i] = g[i] + r[i]
        fused = False
    widen = 0
    while True:
        if exact:
            all_keys = np.empty(n, np.uint32)
            keys(x, all_keys)
            limit = kth_key(all_keys, k)
            expect = k
        else:
            rank = _sample_rank(k, n, sample, slack, widen)
            expect = _candidate_room(k, slack, widen)
            if rank >= sample:
                limit = np.uint32(0)
            else:
                mags = sampled_magnitudes(g if fused else x, r if fused else _NONE, _derive(seed, widen), sample)
                limit = kth_key(mags.view(np.uint32), rank)
        limit_f = np.array([limit], np.uint32).view(np.float32)[0]  # the magnitude of that key
        cand = np.empty(2 * expect + 1024, np.int64)
        vals = np.empty(cand.size, np.float32)
        count = candidates(x, g if fused else _NONE, r if fused else _NONE, limit_f, 0, cand, vals)
        fused = False  # x holds the sum now
        if count > cand.size:
            cand, vals = np.empty(count, np.int64), np.empty(count, np.float32)
            candidates(x, _NONE, _NONE, limit_f, 0, cand, vals)
        if count >= k:
            break
        widen += 1
    cand, vals = cand[:count], vals[:count]
    ckeys = np.empty(count, np.uint32)
    keys(vals, ckeys)
    take_top_np(x, cand, vals, ckeys, kth_key(ckeys, k), k, first, values, chosen)


@_jit
def top_items(x, g, r, x_at, lengths, ks, samples, seeds, out_at, items, slack, values, chosen):
    """:func:`_top_of` for the tensors ``items``: tensor ``t`` is ``x[x_at[t]:][:lengths[t]]``
    (with ``g`` not empty: the sum of ``g`` and ``r`` there), its ``ks[t]`` picks go to
    ``values``/``chosen`` from ``out_at[t]``."""
    for t in items:
        a, e, o = x_at[t], x_at[t] + lengths[t], out_at[t]
        gt, rt = (g[a:e], r[a:e]) if g.size else (g, r)
        _top_of(x[a:e], gt, rt, a, ks[t], samples[t], seeds[t], slack, values[o : o + ks[t]], chosen[o : o + ks[t]])


@_jit
def scatter_add(values, indices, acc):
    """``acc[indices[r, j]] += values[r, j]`` for every rank ``r`` in order, then ``j`` in order."""
    for r in range(values.shape[0]):
        for j in range(values.shape[1]):
            acc[indices[r, j]] += values[r, j]


@_jit
def divide_touched(indices, acc, world):
    """``acc[i] /= world`` once for every index that occurs in ``indices`` (the others are 0)."""
    div = np.float32(world)
    seen = np.zeros((acc.size + 7) >> 3, np.uint8)
    for r in range(indices.shape[0]):
        for j in range(indices.shape[1]):
            i = indices[r, j]
            bit = np.uint8(1 << (i & 7))
            if not seen[i >> 3] & bit:
                seen[i >> 3] |= bit
                acc[i] = acc[i] / div


# ---- torch front-ends ------------------------------------------------------------------


def _f32_out(out: torch.Tensor, start: int, stop: int, fill) -> None:
    """Run ``fill(first, float32 array)`` for ``out[start:stop]``: in place for float32, else
    through a float32 block per ``CHUNK`` rounded into out's dtype."""
    if out.dtype == torch.float32:
        fill(start, _chunks.as_numpy(out[start:stop]))
        return
    for s, e in _chunks.spans(stop - start):
        block = np.empty(e - s, np.float32)
        fill(start + s, block)
        _chunks.write_block(out, start + s, block)


def fill_uniform_tensor(out: torch.Tensor, seed: int, offset: int) -> None:
    """Fill float32 ``out`` with uniforms ``offset ..`` of stream ``seed``."""
    dst = _chunks.as_numpy(out)
    seed64 = np.uint64(seed)
    _chunks.map_blocks(lambda s, e: fill_uniform(dst[s:e], seed64, offset + s), _chunks.parts(out.numel(), 2))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    n = codes.numel()
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8)
    src, dst = _chunks.as_numpy(codes), _chunks.as_numpy(out)
    _chunks.map_blocks(lambda s, e: pack(src[s:e], bits, dst[s * bits // 8 :]), _chunks.parts(n, 8))
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.uint8)
    src, dst = _chunks.as_numpy(packed), _chunks.as_numpy(out)
    _chunks.map_blocks(lambda s, e: unpack(src[s * bits // 8 :], bits, dst[s:e]), _chunks.parts(n, 8))
    return out


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
    _chunks.map_blocks(lambda s, e: _f32_out(flat, s, e, fill), _chunks.parts(n, 4))


def ternary_quantize_pack_many(
    x: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, scales: np.ndarray, bounds: np.ndarray, seeds: np.ndarray
) -> torch.Tensor:
    """The packed codes of the segments ``x[offsets[t] : offsets[t] + lengths[t]]``, end to end."""
    nbytes = (lengths + 3) // 4
    out_at = np.cumsum(nbytes) - nbytes
    out = torch.empty(int(nbytes.sum()), dtype=torch.uint8)
    src, dst = _chunks.as_numpy(x if x.dtype == torch.float32 else x.float()), _chunks.as_numpy(out)
    items = _chunks.segment_items(lengths, 4)
    _chunks.map_blocks(lambda *item: ternary_pack_items(src, scales, bounds, seeds, offsets, out_at, *item, dst), items)
    return out


def ternary_unpack_accumulate_many(
    packed: torch.Tensor, scales: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, out: torch.Tensor
) -> None:
    """Decode every segment's payloads (``packed`` columns end to end) into ``out[offsets[t]:]``."""
    nbytes = (lengths + 3) // 4
    packed_at = np.cumsum(nbytes) - nbytes
    flat = out.view(-1)
    acc = flat if flat.dtype == torch.float32 else flat.float()
    src, sc, dst = _chunks.as_numpy(packed), _chunks.as_numpy(scales.t().contiguous()), _chunks.as_numpy(acc)
    items = _chunks.segment_items(lengths, 4)
    _chunks.map_blocks(lambda *item: ternary_decode_items(src, sc, packed_at, offsets, *item, dst), items)
    if acc is not flat:
        flat.copy_(acc)


def span_stats(x: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(peak float32[T], sum of squares float64[T]) of the segments ``x[offsets[t]:][:lengths[t]]``;
    whole tensors are spread over the threads."""
    src = _chunks.as_numpy(x if x.dtype == torch.float32 else x.float())
    peak, sumsq = np.zeros(offsets.size, np.uint32), np.zeros(offsets.size, np.float64)
    run = lambda items: span_stats_items(src, src.view(np.uint32), offsets, lengths, items, peak, sumsq)  # noqa: E731
    _chunks.map_blocks(run, [(items,) for items in _chunks.whole_segments(lengths)])
    return peak.view(np.float32), sumsq


def quantize_pack(
    x: torch.Tensor, bits: int, bucket_size: int, seed: int, packed: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor
) -> None:
    """Fill ``packed``, ``mins`` and ``scales`` for contiguous ``x``."""
    dst, mins_np, scales_np = _chunks.as_numpy(packed), _chunks.as_numpy(mins), _chunks.as_numpy(scales)
    levels, seed64 = (1 << bits) - 1, np.uint64(seed)
    align = bucket_size * (8 // np.gcd(bucket_size * bits, 8))  # spans start on a bucket and a byte

    def body(start: int, stop: int) -> None:
        block = _chunks.float32_block(x, start, stop)  # a view for float32
        j = start // bucket_size
        quantize(block, levels, bits, bucket_size, seed64, start, mins_np[j:], scales_np[j:], dst[start * bits // 8 :])

    _chunks.map_blocks(body, _chunks.parts(x.numel(), int(align)))


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
    _chunks.map_blocks(lambda s, e: _f32_out(flat, s, e, fill), _chunks.parts(n, 8))


def select_candidates(
    flat: torch.Tensor, threshold: float, expect: int, addends: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Increasing int64 indices of the entries of ``flat`` whose magnitude is not below
    ``threshold`` (NaN included), and their values; ``expect`` sizes the buffers (about how
    many there are). With ``addends`` (g, r) (float32, like ``flat``), ``flat = g + r``
    first, in the same pass."""
    n = flat.numel()
    limit = np.float32(threshold)
    spans = _chunks.parts(n, 1)
    x = _chunks.as_numpy(flat)
    g, r = (None, None) if addends is None else (_chunks.as_numpy(addends[0]), _chunks.as_numpy(addends[1]))
    if not limit > 0:  # every magnitude (NaN too) is at least 0
        if g is not None:
            _chunks.map_blocks(lambda start, stop: np.add(g[start:stop], r[start:stop], out=x[start:stop]), spans)
        return torch.arange(n), flat.clone()
    room = 2 * expect // max(1, len(spans)) + 1024

    def body(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        cand, vals = np.empty(room, np.int64), np.empty(room, np.float32)
        gs, rs = (_NONE, _NONE) if g is None else (g[start:stop], r[start:stop])
        count = candidates(x[start:stop], gs, rs, limit, start, cand, vals)
        if count > room:  # more than the estimate: count known now, run again (on the sum)
            cand, vals = np.empty(count, np.int64), np.empty(count, np.float32)
            candidates(x[start:stop], _NONE, _NONE, limit, start, cand, vals)
        return cand[:count], vals[:count]

    found = _chunks.map_blocks(body, spans)
    if not found:
        return torch.empty(0, dtype=torch.int64), flat.new_empty(0)
    return torch.from_numpy(np.concatenate([f[0] for f in found])), torch.from_numpy(np.concatenate([f[1] for f in found]))


def sample_threshold(
    flat: torch.Tensor, seed: int, sample: int, rank: int, addends: tuple[torch.Tensor, torch.Tensor] | None = None
) -> float:
    """The ``rank``-th largest magnitude among the sampled entries of float32 ``flat`` (of
    ``g + r`` with ``addends``)."""
    x, r = (flat, _NONE) if addends is None else (addends[0], _chunks.as_numpy(addends[1]))
    mags = sampled_magnitudes(_chunks.as_numpy(x), r, np.uint64(seed), sample)
    return _as_float(kth_key(mags.view(np.uint32), rank))  # magnitudes: their bits are their keys


def exact_threshold(flat: torch.Tensor, k: int) -> float:
    """The ``k``-th largest magnitude (NaN as +inf) of float32 ``flat``."""
    n = flat.numel()
    src, all_keys = _chunks.as_numpy(flat), np.empty(n, np.uint32)
    _chunks.map_blocks(lambda s, e: keys(src[s:e], all_keys[s:e]), _chunks.parts(n, 1))
    return _as_float(kth_key(all_keys, k))


def _as_float(key: np.uint32) -> float:
    """The magnitude whose :func:`_key` is ``key``."""
    return float(np.array([key], np.uint32).view(np.float32)[0])


def take_top(flat: torch.Tensor, candidates_: torch.Tensor, cvalues: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int32 indices) of the ``k`` largest magnitudes among ``candidates_`` of float32
    ``flat`` (their values ``cvalues``; ties to the lower index), zeroed in ``flat``."""
    x, cand, vals = _chunks.as_numpy(flat), _chunks.as_numpy(candidates_), _chunks.as_numpy(cvalues)
    ckeys = np.empty(vals.size, np.uint32)
    keys(vals, ckeys)
    values = torch.empty(k, dtype=torch.float32)
    chosen = torch.empty(k, dtype=torch.int32)
    take_top_np(x, cand, vals, ckeys, kth_key(ckeys, k), k, 0, _chunks.as_numpy(values), _chunks.as_numpy(chosen))
    return values, chosen


def take_top_many(
    flat: torch.Tensor,
    addends: tuple[torch.Tensor, torch.Tensor] | None,
    offsets: np.ndarray,
    lengths: np.ndarray,
    ks: np.ndarray,
    samples: np.ndarray,
    seeds: np.ndarray,
    out_at: np.ndarray,
    slack: float,
    values: torch.Tensor,
    chosen: torch.Tensor,
) -> None:
    """:func:`_top_of` for every tensor ``flat[offsets[t]:][:lengths[t]]`` of float32 ``flat``
    (``samples[t]`` 0: exact threshold; ``addends`` (g, r) float32: first ``flat = g + r``
    there), its picks into ``values``/``chosen`` from ``out_at[t]``; whole tensors are spread
    over the threads."""
    x, v, c = _chunks.as_numpy(flat), _chunks.as_numpy(values), _chunks.as_numpy(chosen)
    g, r = (_NONE, _NONE) if addends is None else (_chunks.as_numpy(addends[0]), _chunks.as_numpy(addends[1]))
    run = lambda items: top_items(x, g, r, offsets, lengths, ks, samples, seeds, out_at, items, slack, v, c)  # noqa: E731
    _chunks.map_blocks(run, [(items,) for items in _chunks.whole_segments(lengths)])


def scatter_add_decode(values: torch.Tensor, indices: torch.Tensor, n: int, out: torch.Tensor, average: bool) -> None:
    world = values.shape[0]
    flat = out.view(-1)
    acc = flat.zero_() if flat.dtype == torch.float32 else torch.zeros(n, dtype=torch.float32)
    acc_np = _chunks.as_numpy(acc)
    idx = _chunks.as_numpy(indices.contiguous())
    scatter_add(_chunks.as_numpy(values.float().contiguous()), idx, acc_np)
    if average and world > 1:
        divide_touched(idx, acc_np, world)
    if acc is not flat:
        flat.copy_(acc)
