"""The kernels' definitions in plain numpy and torch: the oracle the kernel tests compare with.

Every function here has the signature of the op of the same name in :mod:`commpress.kernels`
(CPU tensors, valid arguments: the checks are the front ends' business) and computes it the
simplest way that follows the op's documented arithmetic step for step, so its bits are the
ones the compiled CPU kernels and the CUDA kernels must give. Vectorized over whole arrays,
no threads, no pieces: slow enough for test sizes only.

SplitMix64 is written here once more, in Python integers (:func:`mix64`, the reference) and
in numpy uint64 arrays (:func:`words`); the tests check the library's three runtimes (numba,
CUDA, torch integer ops) against them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from commpress.kernels._constants import STATS_LANES, STATS_ROWS

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
SEED_BASIS = 0x6A09E667F3BCC908


# ---- SplitMix64 -------------------------------------------------------------------------


def mix64(z: int) -> int:
    """SplitMix64's output function on a Python int."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def derive_seed(*values: int) -> int:
    """The key of ``values``: each folded in as ``h = mix64((h ^ v) + GAMMA)`` from SEED_BASIS."""
    h = SEED_BASIS
    for v in values:
        h = mix64(((h ^ (v & MASK64)) + GAMMA) & MASK64)
    return h


def words(seed: int, first: int, count: int) -> np.ndarray:
    """SplitMix64 words ``first .. first + count - 1`` of stream ``seed`` (uint64)."""
    z = np.arange(first, first + count, dtype=np.uint64) * np.uint64(GAMMA) + np.uint64(seed & MASK64)
    z ^= z >> np.uint64(30)
    z *= np.uint64(MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(MIX2)
    z ^= z >> np.uint64(31)
    return z


def bits32(seed: int, count: int, offset: int = 0) -> np.ndarray:
    """Draws ``offset .. offset + count - 1`` (uint32) of stream ``seed``."""
    skip = offset & 1
    return words(seed, offset >> 1, (skip + count + 1) >> 1).view(np.uint32)[skip : skip + count]


def _uniform_np(seed: int, n: int, offset: int) -> np.ndarray:
    return ((bits32(seed, n, offset) & np.uint32(0x7FFFFF)).astype(np.float32) * np.float32(2.0**-23)).astype(np.float32)


def uniform(seed: int, n: int, offset: int = 0, device=None) -> torch.Tensor:
    return torch.from_numpy(_uniform_np(seed, n, offset))


# ---- bit packing -------------------------------------------------------------------------


def _pack_np(codes: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    n = codes.size
    padded = np.zeros(-(-n // per) * per, np.uint16)
    padded[:n] = codes & ((1 << bits) - 1)
    shifts = (np.arange(per) * bits).astype(np.uint16)
    return (padded.reshape(-1, per) << shifts).sum(axis=1, dtype=np.uint16).astype(np.uint8)


def _unpack_np(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    per = 8 // bits
    shifts = (np.arange(per) * bits).astype(np.uint8)
    return ((packed[:, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(-1)[:n].astype(np.uint8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.from_numpy(_pack_np(codes.reshape(-1).numpy(), bits))


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    return torch.from_numpy(_unpack_np(packed.reshape(-1).numpy(), bits, n))


def _write(out: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """Store float32 ``values`` into ``out``, rounded to its dtype (nearest even)."""
    out.view(-1).copy_(torch.from_numpy(values))
    return out


# ---- TernGrad ----------------------------------------------------------------------------


@np.errstate(invalid="ignore", divide="ignore")
def ternary_quantize_pack(x: torch.Tensor, scale: torch.Tensor, seed: int, bound: torch.Tensor | None = None) -> torch.Tensor:
    """Code 1 (+) or 2 (-) where ``u < min(|x|, bound) / scale`` (NaN never), else 0; zeros if scale is not > 0."""
    xs = x.reshape(-1).float().numpy()
    n = xs.size
    s = np.float32(scale.item())
    if not s > 0:
        return torch.zeros(-(-n // 4), dtype=torch.uint8)
    b = np.float32(np.inf if bound is None else bound.item())
    p = np.minimum(np.abs(xs), b) / s
    keep = (_uniform_np(seed, n, 0) < p).astype(np.uint8)
    codes = keep << np.signbit(xs).astype(np.uint8)
    return torch.from_numpy(_pack_np(codes, 2))


def ternary_unpack_accumulate(packed: torch.Tensor, scales: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in rank order, of ``scale_r * {0, +1, -1, 0}[code]``, in float32, / world if > 1."""
    world = packed.shape[0]
    acc = None
    for r in range(world):
        s = np.float32(scales[r].item())
        table = np.array([0.0, s, -s, 0.0], np.float32)
        values = table[_unpack_np(packed[r].numpy(), 2, n)]
        acc = values if acc is None else acc + values
    if world > 1:
        acc = acc / np.float32(world)
    return _write(out, acc)


def ternary_quantize_pack_many(x, spans, scales, seeds, bounds=None) -> torch.Tensor:
    pieces = [
        ternary_quantize_pack(x[o : o + n], scales[t], seeds[t], None if bounds is None else bounds[t])
        for t, (o, n) in enumerate(spans)
    ]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


def ternary_unpack_accumulate_many(packed, scales, spans, out) -> torch.Tensor:
    at = 0
    for t, (o, n) in enumerate(spans):
        nbytes = -(-n // 4)
        ternary_unpack_accumulate(packed[:, at : at + nbytes], scales[:, t].contiguous(), n, out[o : o + n])
        at += nbytes
    return out


# ---- b-bit bucket quantization -----------------------------------------------------------


def _buckets(a: np.ndarray, size: int) -> list[np.ndarray]:
    """``a`` as [rows, size] views of its whole buckets, and the partial last one (if any) as [1, rest]."""
    full = a.size - a.size % size
    return ([a[:full].reshape(-1, size)] if full else []) + ([a[full:].reshape(1, -1)] if full < a.size else [])


@np.errstate(invalid="ignore", divide="ignore")
def quantize_pack(x: torch.Tensor, bits: int, bucket_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per bucket ``lo = min + 0``, ``scale = (max + 0 - lo) / levels`` (NaN if the bucket holds
    one); code ``floor((x - lo) / scale + u)`` clamped to [0, levels] (NaN: 0), all zero where
    the scale is 0."""
    xs = x.reshape(-1).float().numpy()
    levels = np.float32((1 << bits) - 1)
    u = _uniform_np(seed, xs.size, 0)
    codes = np.empty(xs.size, np.uint8)
    mins, scales = [], []
    for xb, ub, cb in zip(_buckets(xs, bucket_size), _buckets(u, bucket_size), _buckets(codes, bucket_size)):
        lo = xb.min(axis=1) + np.float32(0.0)  # NaN if the bucket holds one
        scale = (xb.max(axis=1) + np.float32(0.0) - lo) / levels
        t = (xb - lo[:, None]) / scale[:, None] + ub
        cb[...] = np.minimum(np.fmax(t, np.float32(0.0)), levels)  # fmax maps NaN to 0; truncation is floor
        cb[scale == 0] = 0
        mins.append(lo)
        scales.append(scale)
    mins, scales = (np.concatenate(v) if v else np.empty(0, np.float32) for v in (mins, scales))
    return torch.from_numpy(_pack_np(codes, bits)), torch.from_numpy(mins), torch.from_numpy(scales)


@np.errstate(invalid="ignore")
def unpack_accumulate(packed, mins, scales, bits: int, bucket_size: int, n: int, out: torch.Tensor, average: bool = True):
    """Sum over ranks, in rank order, of ``code * scale + lo`` per element, in float32, / world when averaging."""
    world = packed.shape[0]
    bucket = np.arange(n) // bucket_size
    acc = None
    for r in range(world):
        codes = _unpack_np(packed[r].numpy(), bits, n).astype(np.float32)
        values = codes * scales[r].numpy()[bucket] + mins[r].numpy()[bucket]
        acc = values if acc is None else acc + values
    if average and world > 1:
        acc = acc / np.float32(world)
    return _write(out, acc)


def dequantize(packed, mins, scales, bits: int, bucket_size: int, n: int, out: torch.Tensor | None = None):
    out = torch.empty(n, dtype=torch.float32) if out is None else out
    return unpack_accumulate(packed[None], mins[None], scales[None], bits, bucket_size, n, out, average=False)


# ---- span statistics ---------------------------------------------------------------------


def span_stats(x: torch.Tensor, spans: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest ``bits & 0x7FFFFFFF`` as a float32, and the float64 sum of squares: rows of a chunk
    in order, chunks in order, lanes in order."""
    xs = x.float().numpy()
    peaks, sums = [], []
    for o, n in spans:
        block = xs[o : o + n]
        peaks.append(np.max(block.view(np.uint32) & np.uint32(0x7FFFFFFF)) if n else np.uint32(0))
        sums.append(_stats_sum(block.astype(np.float64) ** 2))
    return torch.from_numpy(np.array(peaks, np.uint32).view(np.float32)), torch.from_numpy(np.array(sums, np.float64))


def _stats_sum(values: np.ndarray) -> float:
    """The float64 sum of ``values`` (all >= 0) in span_stats' order."""
    chunk = STATS_LANES * STATS_ROWS
    padded = np.zeros(-(-values.size // chunk) * chunk, np.float64)  # padding adds +0.0: no change to a sum >= 0
    padded[: values.size] = values
    lanes = np.add.reduce(padded.reshape(-1, STATS_ROWS, STATS_LANES), axis=1)  # rows in order
    lanes = np.add.reduce(lanes, axis=0) if lanes.size else np.zeros(STATS_LANES)  # chunks in order
    return np.cumsum(lanes)[-1]  # lanes in order


# ---- 1-bit signs ---------------------------------------------------------------------------


@np.errstate(invalid="ignore")
def sign_pack_many(x, spans, error=None, acc=None) -> tuple[torch.Tensor, torch.Tensor]:
    """a = x (+ error, float32; stored in ``acc``); bit 1 where a < 0, 8 per byte; scale =
    float32(sum|a| / n), the sum in span_stats' order (0 for an empty span)."""
    a = x.float().numpy() if error is None else x.float().numpy() + error.numpy()
    pieces, scales = [], []
    for o, n in spans:
        block = a[o : o + n]
        if acc is not None:
            acc.numpy()[o : o + n] = block
        pieces.append(_pack_np((block < 0).astype(np.uint8), 1))
        scales.append(np.float32(_stats_sum(np.abs(block).astype(np.float64)) / max(n, 1)))
    packed = np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)
    return torch.from_numpy(packed), torch.from_numpy(np.array(scales, np.float32))


def sign_unpack_accumulate_many(packed, scales, spans, out, residual=None, rank=0) -> torch.Tensor:
    """Per span: the sum over ranks, in order, of ``+-scale_r`` (bit 1: minus) in float32, / world
    if > 1, into ``out``; ``residual`` minus ``rank``'s own value."""
    world, at = packed.shape[0], 0
    for t, (o, n) in enumerate(spans):
        nbytes = -(-n // 8)
        rows = []
        for r in range(world):
            s = np.float32(scales[r, t].item())
            bits = _unpack_np(packed[r, at : at + nbytes].numpy(), 1, n)
            rows.append(np.where(bits == 1, -s, s).astype(np.float32))
        total = rows[0]
        for row in rows[1:]:
            total = total + row
        if world > 1:
            total = total / np.float32(world)
        _write(out[o : o + n], total)
        if residual is not None:
            residual.numpy()[o : o + n] -= rows[rank]
        at += nbytes
    return out


# ---- top-k -------------------------------------------------------------------------------


def topk_select(acc: torch.Tensor, k: int, exact: bool = False, sample: int | None = None, seed: int = 0):
    """The ``k`` largest magnitudes (NaN as +inf), ties to the lower index, in index order; zeroed in ``acc``."""
    flat = acc.view(-1)
    mag = torch.nan_to_num(flat.float().abs(), nan=math.inf, posinf=math.inf)
    chosen = torch.sort(mag, descending=True, stable=True).indices[:k].sort().values
    values = flat[chosen].clone()
    flat[chosen] = 0
    return values, chosen.to(torch.int32)


def topk_select_many(acc, spans, counts, seeds, exact, grad=None, error=None):
    if grad is not None:
        for o, n in spans:
            acc[o : o + n] = error[o : o + n] + grad[o : o + n].float()
    picked = [topk_select(acc[o : o + n], k) for (o, n), k in zip(spans, counts)]
    values = torch.cat([v for v, _ in picked]) if picked else acc.new_empty(0)
    indices = torch.cat([i + o for (_, i), (o, _) in zip(picked, spans)]) if picked else torch.empty(0, dtype=torch.int32)
    return values, indices.to(torch.int32)


def scatter_add_decode(values: torch.Tensor, indices: torch.Tensor, n: int, out: torch.Tensor, average: bool = True):
    """``acc[indices[r]] += values[r]`` for every rank in order, in float32, / world when averaging."""
    world = values.shape[0]
    acc = torch.zeros(n, dtype=torch.float32)
    for r in range(world):
        acc.index_add_(0, indices[r].long(), values[r].float())
    if average and world > 1:
        acc.div_(world)
    out.view(-1).copy_(acc)
    return out
