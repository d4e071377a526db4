"""Top-k on the CPU (numba): the sampled threshold, the candidates, the exact k among them, the decode."""

from __future__ import annotations

import numpy as np
import torch
from numba.cpython.unsafe.numbers import trailing_zeros

from commpress.kernels._constants import candidate_room, sample_rank

from . import _chunks
from ._jit import KEY_ABS, NONE, PIECE, inline, jit
from .rng import derive2, words_of

__all__ = [
    "exact_threshold",
    "sample_threshold",
    "scatter_add_decode",
    "select_candidates",
    "take_top",
    "take_top_many",
]

_S32 = np.uint64(32)
_KEY_INF = np.uint32(0x7F800000)  # +inf's bits: the largest top-k key (NaN is given it too)
_sample_rank = inline(sample_rank)  # the front end's own arithmetic, compiled
_candidate_room = inline(candidate_room)


@inline
def _magnitude(v):
    """|v| with NaN as +inf (the order of ``torch.topk``)."""
    a = abs(v)
    return a if a == a else np.float32(np.inf)


@jit
def sampled_magnitudes(x, r, seed, sample):
    """Magnitudes (NaN as +inf) of ``sample`` entries of ``x`` (of ``x + r`` when ``r`` is not
    empty): entry ``j`` is ``floor(draw_j * n / 2**32)``, with draw ``j`` of stream ``seed``."""
    n = np.uint64(x.size)
    words = np.empty((sample + 1) >> 1, np.uint64)
    words_of(seed, words)  # vectorized; the gather below is not
    draws = words.view(np.uint32)
    mags = np.empty(sample, np.float32)
    for j in range(sample):
        i = (np.uint64(draws[j]) * n) >> _S32
        mags[j] = _magnitude(x[i] + r[i] if r.size else x[i])
    return mags


@inline
def _hits(flags, words, length, xs, base, count, cand, vals):
    """Append ``base + i`` and ``xs[i]`` to ``cand``/``vals`` (while there is room) for every set flag
    of a piece, eight flags a word; return the new count."""
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


@jit
def candidates(x, g, r, limit, first, cand, vals):
    """Write ``first + i`` and ``x[i]`` for each ``i`` with key not below ``limit``'s into ``cand``/``vals``
    while they have room; return how many there are. With ``g`` not empty, ``x = g + r`` first, tested
    while in cache; the values are kept so the selection never reads ``x`` again."""
    xb = x.view(np.uint32)
    limit_bits = np.array([limit], np.float32).view(np.uint32)[0]
    count = 0
    flags = np.zeros(PIECE, np.uint8)
    words = flags.view(np.uint64)
    for ps in range(0, x.size, PIECE):
        pe = min(x.size, ps + PIECE)
        xs, bits = x[ps:pe], xb[ps:pe]  # piece views: the loops vectorize
        if g.size:
            gs, rs = g[ps:pe], r[ps:pe]
            for i in range(pe - ps):
                xs[i] = gs[i] + rs[i]
        for i in range(pe - ps):
            flags[i] = (bits[i] & KEY_ABS) >= limit_bits
        count = _hits(flags, words, pe - ps, xs, first + ps, count, cand, vals)
    return count


@inline
def _key(bits):
    """A magnitude's order as an integer: |x|'s bits (ordered like the floats), NaN given +inf's."""
    a = bits & KEY_ABS
    return a if a <= _KEY_INF else _KEY_INF


@jit
def keys(x, out):
    """``out[i]`` = :func:`_key` of float32 ``x[i]``: its magnitude's order as an integer."""
    xb = x.view(np.uint32)
    for i in range(x.size):
        out[i] = _key(xb[i])


@jit
def take_top_np(x, cand, vals, k, first, values, chosen):
    """Of ``cand`` (values ``vals``), the ``k`` whose key is above the ``k``-th largest, plus the first ties
    at it: values into ``values``, indices + ``first`` into ``chosen``, zeroed in ``x``."""
    mags = np.empty(vals.size, np.uint32)
    keys(vals, mags)
    kth = kth_key(mags, k)
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


@jit
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


@jit
def _top_of(x, g, r, first, k, sample, seed, slack, values, chosen):
    """``topk_select`` of float32 ``x`` (indices written as ``first + i``; ``sample`` 0: exact threshold);
    with ``g`` not empty, ``x = g + r`` first (in the candidates' pass when the threshold is sampled)."""
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
                mags = sampled_magnitudes(g if fused else x, r if fused else NONE, derive2(seed, widen), sample)
                limit = kth_key(mags.view(np.uint32), rank)
        limit_f = np.array([limit], np.uint32).view(np.float32)[0]  # the magnitude of that key
        cand = np.empty(2 * expect + 1024, np.int64)
        vals = np.empty(cand.size, np.float32)
        count = candidates(x, g if fused else NONE, r if fused else NONE, limit_f, 0, cand, vals)
        fused = False  # x holds the sum now
        if count > cand.size:
            cand, vals = np.empty(count, np.int64), np.empty(count, np.float32)
            candidates(x, NONE, NONE, limit_f, 0, cand, vals)
        if count >= k:
            break
        widen += 1
    take_top_np(x, cand[:count], vals[:count], k, first, values, chosen)


@jit
def top_items(x, g, r, x_at, lengths, ks, samples, seeds, out_at, items, slack, values, chosen):
    """:func:`_top_of` for the tensors ``items`` (``x[x_at[t]:][:lengths[t]]``), picks from ``out_at[t]``."""
    for t in items:
        a, e, o = x_at[t], x_at[t] + lengths[t], out_at[t]
        gt, rt = (g[a:e], r[a:e]) if g.size else (g, r)
        _top_of(x[a:e], gt, rt, a, ks[t], samples[t], seeds[t], slack, values[o : o + ks[t]], chosen[o : o + ks[t]])


@jit
def scatter_add(values, indices, acc):
    """``acc[indices[r, j]] += values[r, j]`` for every rank ``r`` in order, then ``j`` in order."""
    for r in range(values.shape[0]):
        for j in range(values.shape[1]):
            acc[indices[r, j]] += values[r, j]


@jit
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


def select_candidates(
    flat: torch.Tensor, threshold: float, expect: int, addends: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Increasing int64 indices of the entries of ``flat`` not below ``threshold`` in magnitude, and
    their values; ``expect`` sizes the buffers. With ``addends`` ``(g, r)``, ``flat = g + r`` in the same pass."""
    n = flat.numel()
    limit = np.float32(threshold)
    spans = _chunks.parts(n, 1)
    x = _chunks.as_numpy(flat)
    g, r = (NONE, NONE) if addends is None else (_chunks.as_numpy(addends[0]), _chunks.as_numpy(addends[1]))
    if not limit > 0:  # every magnitude (NaN too) is at least 0
        if g.size:
            _chunks.map_blocks(lambda start, stop: np.add(g[start:stop], r[start:stop], out=x[start:stop]), spans)
        return torch.arange(n), flat.clone()
    room = 2 * expect // max(1, len(spans)) + 1024

    def body(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        cand, vals = np.empty(room, np.int64), np.empty(room, np.float32)
        count = candidates(x[start:stop], g[start:stop], r[start:stop], limit, start, cand, vals)
        if count > room:  # more than the estimate: count known now, run again (on the sum)
            cand, vals = np.empty(count, np.int64), np.empty(count, np.float32)
            candidates(x[start:stop], NONE, NONE, limit, start, cand, vals)
        return cand[:count], vals[:count]

    found = _chunks.map_blocks(body, spans)
    if not found:
        return torch.empty(0, dtype=torch.int64), flat.new_empty(0)
    return torch.from_numpy(np.concatenate([f[0] for f in found])), torch.from_numpy(np.concatenate([f[1] for f in found]))


def sample_threshold(
    flat: torch.Tensor, seed: int, sample: int, rank: int, addends: tuple[torch.Tensor, torch.Tensor] | None = None
) -> float:
    """The ``rank``-th largest sampled magnitude of float32 ``flat`` (of ``g + r`` with ``addends``)."""
    x, r = (flat, NONE) if addends is None else (addends[0], _chunks.as_numpy(addends[1]))
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
    """(values, int32 indices) of the ``k`` largest among ``candidates_`` (values ``cvalues``), zeroed in ``flat``."""
    x, cand, vals = _chunks.as_numpy(flat), _chunks.as_numpy(candidates_), _chunks.as_numpy(cvalues)
    values = torch.empty(k, dtype=torch.float32)
    chosen = torch.empty(k, dtype=torch.int32)
    take_top_np(x, cand, vals, k, 0, _chunks.as_numpy(values), _chunks.as_numpy(chosen))
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
    """:func:`_top_of` for every tensor ``flat[offsets[t]:][:lengths[t]]``, whole tensors per thread."""
    x, v, c = _chunks.as_numpy(flat), _chunks.as_numpy(values), _chunks.as_numpy(chosen)
    g, r = (NONE, NONE) if addends is None else (_chunks.as_numpy(addends[0]), _chunks.as_numpy(addends[1]))
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
