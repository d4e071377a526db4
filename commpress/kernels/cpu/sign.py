"""1-bit sign codes on the CPU (numba): signs, acc and magnitude sums in one pass; decode and residual in one."""

from __future__ import annotations

import numpy as np
import torch

from commpress.kernels._constants import STATS_LANES, STATS_ROWS

from . import _chunks
from ._jit import NONE, PIECE, ZERO, jit
from .bitpack import pack_fixed
from .ternary import ranks_average

__all__ = ["sign_pack", "sign_unpack_accumulate"]

_CHUNK = STATS_LANES * STATS_ROWS  # elements per chunk of the magnitude sums (a multiple of 8)


@jit
def sign_pack_items(x, error, acc, offsets, out_at, chunk_at, item_segment, item_start, item_stop, sums, packed):
    """Per item ``(t, start, stop)``, ``start`` a chunk multiple: each ``a = x`` (``+ error``, kept in ``acc``,
    when ``error`` is not empty) as a sign bit into ``packed``, and each chunk's lane sums of ``|a|``."""
    feedback = error.size > 0
    bits = np.empty(STATS_LANES, np.uint8)
    for i in range(item_segment.size):
        t, s, e = item_segment[i], item_start[i], item_stop[i]
        base = offsets[t]
        for cs in range(s, e, _CHUNK):
            ce = min(e, cs + _CHUNK)
            part = sums[chunk_at[t] + cs // _CHUNK]
            part[:] = 0.0
            for rs in range(cs, ce, STATS_LANES):
                m = min(ce, rs + STATS_LANES) - rs
                xs = x[base + rs : base + rs + m]
                if feedback:
                    es, av = error[base + rs : base + rs + m], acc[base + rs : base + rs + m]
                    for j in range(m):
                        a = xs[j] + es[j]
                        av[j] = a
                        part[j] += abs(np.float64(a))
                        bits[j] = np.uint8(a < ZERO)
                else:
                    for j in range(m):
                        a = xs[j]
                        part[j] += abs(np.float64(a))
                        bits[j] = np.uint8(a < ZERO)
                pack_fixed(bits[:m], packed[out_at[t] + (rs >> 3) : out_at[t] + ((rs + m + 7) >> 3)], 8, 1)


@jit
def chunk_totals(sums, chunk_at, totals):
    """Per span: its chunks' lane sums, then the lanes, each in order (span_stats' order)."""
    lanes = np.empty(STATS_LANES, np.float64)
    for t in range(totals.size):
        lanes[:] = 0.0
        for g in range(chunk_at[t], chunk_at[t + 1]):
            for j in range(STATS_LANES):
                lanes[j] += sums[g, j]
        total = 0.0
        for j in range(STATS_LANES):
            total += lanes[j]
        totals[t] = total


@jit
def sign_decode_items(packed, scales, packed_at, offsets, rank, item_segment, item_start, item_stop, out, residual):
    """Per item (``start`` a multiple of 8): ``out`` = the rank-order sum of ``+-scales[t, r]`` (bit 1:
    minus), / world if > 1, and ``residual`` (if not empty) minus ``rank``'s own value."""
    world = packed.shape[0]
    div = np.float32(world)
    part = np.empty(world * PIECE, np.float32)
    value = np.empty(2, np.float32)
    for i in range(item_segment.size):
        t, s, e = item_segment[i], item_start[i], item_stop[i]
        o, pa = offsets[t], packed_at[t]
        for ps in range(s, e, PIECE):
            m = min(e, ps + PIECE) - ps
            for r in range(world):
                value[0], value[1] = scales[t, r], -scales[t, r]
                src = packed[r, pa + (ps >> 3) :]
                row = part[r * PIECE : r * PIECE + m]
                for k in range(m):
                    row[k] = value[(src[k >> 3] >> (k & 7)) & 1]
            if residual.size:
                own, res = part[rank * PIECE : rank * PIECE + m], residual[o + ps : o + ps + m]
                for k in range(m):
                    res[k] -= own[k]
            ranks_average(part, world, PIECE, div, out[o + ps : o + ps + m])


def sign_pack(
    x: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, error: torch.Tensor | None, acc: torch.Tensor | None
) -> tuple[torch.Tensor, np.ndarray]:
    """The packed signs of every span (end to end) and the float64 sums of their magnitudes."""
    nbytes = (lengths + 7) // 8
    out_at = np.cumsum(nbytes) - nbytes
    per = -(-lengths // _CHUNK)
    chunk_at = np.concatenate([np.zeros(1, np.int64), np.cumsum(per)])
    packed = torch.empty(int(nbytes.sum()), dtype=torch.uint8)
    sums = np.empty((int(chunk_at[-1]), STATS_LANES), np.float64)
    src, dst = _chunks.as_numpy(x.float()), _chunks.as_numpy(packed)
    err = NONE if error is None else _chunks.as_numpy(error)
    out = NONE if acc is None else _chunks.as_numpy(acc)
    items = _chunks.segment_items(lengths, _CHUNK)
    _chunks.map_blocks(lambda *item: sign_pack_items(src, err, out, offsets, out_at, chunk_at, *item, sums, dst), items)
    totals = np.empty(lengths.size, np.float64)
    chunk_totals(sums, chunk_at, totals)
    return packed, totals


def sign_unpack_accumulate(
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: np.ndarray,
    lengths: np.ndarray,
    out: torch.Tensor,
    residual: torch.Tensor | None,
    rank: int,
) -> None:
    """Decode every span's payloads into ``out[offsets[t]:]``; take this rank's values from ``residual``."""
    nbytes = (lengths + 7) // 8
    packed_at = np.cumsum(nbytes) - nbytes
    flat = out.view(-1)
    acc = flat.float()  # flat itself for float32
    src, sc, dst = _chunks.as_numpy(packed), _chunks.as_numpy(scales.t().contiguous()), _chunks.as_numpy(acc)
    res = NONE if residual is None else _chunks.as_numpy(residual)
    items = _chunks.segment_items(lengths, 8)
    _chunks.map_blocks(lambda *item: sign_decode_items(src, sc, packed_at, offsets, rank, *item, dst, res), items)
    if acc is not flat:
        flat.copy_(acc)
