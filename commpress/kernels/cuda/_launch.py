"""The CUDA side of every op, called by the front ends after their checks: allocate outputs with
torch and run the ``.cu`` kernels; Top-k's selection is torch ops around two kernels."""

from __future__ import annotations

import math

import numpy as np
import torch

from commpress.kernels._constants import STATS_LANES, STATS_ROWS

from ._cupy import launch

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # CP_F32, CP_F16, CP_BF16 in common.cuh
UNROLL = 4  # units per thread in one pass of the streaming kernels: CP_UNROLL in common.cuh
SPAN = 8  # elements a thread of cp_bucket_quantize reads at a time for the min/max: CP_SPAN in quantize.cu


def _inverse(world: int, average: bool = True) -> np.float32:
    """The kernels' ``inverse`` (cp_average in common.cuh): 1 for no division, 1/world for a power of
    two (a multiply with the division's bits), else 0 for a division."""
    if not average or world == 1:
        return np.float32(1.0)
    return np.float32(1.0 / world) if world & (world - 1) == 0 else np.float32(0.0)


def _threads(units: int) -> int:
    """Threads for ``units`` units of a kernel that takes UNROLL of them per thread and pass."""
    return -(-units // UNROLL)


def _code(t: torch.Tensor) -> np.int32:
    return np.int32(_DTYPE_CODE[t.dtype])


def uniform(seed: int, n: int, offset: int, device: torch.device) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.float32, device=device)
    words = (offset + n - 1) // 2 - offset // 2 + 1 if n else 0  # generator words the draws take
    launch("rng", "cp_uniform_kernel", device, _threads(words), (out, np.int64(n), np.uint64(seed), np.uint64(offset)))
    return out


def sample_indices(seed: int, count: int, n: int, device: torch.device) -> torch.Tensor:
    out = torch.empty(count, dtype=torch.int64, device=device)
    launch("rng", "cp_sample_indices", device, count, (out, np.int64(count), np.uint64(seed), np.int64(n)))
    return out


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    codes = codes.contiguous()
    n = codes.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=codes.device)
    launch("bitpack", "cp_pack_bits", codes.device, _threads(out.numel()), (codes, out, np.int64(n), np.int32(bits)))
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    packed = packed.contiguous()
    out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    launch("bitpack", "cp_unpack_bits", packed.device, _threads(n), (packed, out, np.int64(n), np.int32(bits)))
    return out


def ternary_quantize_pack(x: torch.Tensor, scale: torch.Tensor, seed: int) -> torch.Tensor:
    x = x.contiguous()
    n = x.numel()
    out = torch.empty((n + 3) // 4, dtype=torch.uint8, device=x.device)
    launch(
        "ternary",
        "cp_ternary_quantize_pack",
        x.device,
        _threads(out.numel()),
        (x, _code(x), scale.contiguous(), out, np.int64(n), np.uint64(seed)),
    )
    return out


def ternary_unpack_accumulate(packed: torch.Tensor, scales: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    world, m = packed.shape
    args = (packed, scales, out, _code(out), np.int64(n), np.int64(m), np.int32(world), _inverse(world))
    launch("ternary", "cp_ternary_unpack_accumulate", out.device, _threads(m), args)
    return out


_NULL = np.uint64(0)  # a null pointer argument: the kernel leaves that array alone


def _chunk_list(offsets: np.ndarray, lengths: np.ndarray, device: torch.device) -> tuple[int, list[torch.Tensor]]:
    """The spans cut into span_stats' chunks: their count and, on ``device``, each chunk's first
    element, end and first byte at one bit per element, and each span's first chunk (plus the count)."""
    chunk = STATS_LANES * STATS_ROWS
    per = -(-lengths // chunk)
    span_chunks = np.concatenate([np.zeros(1, np.int64), np.cumsum(per)])
    count = int(span_chunks[-1])
    tensor = np.repeat(np.arange(lengths.size), per)
    within = (np.arange(count) - span_chunks[:-1][tensor]) * chunk
    first = offsets[tensor] + within
    end = np.minimum(first + chunk, (offsets + lengths)[tensor])
    nbytes = (lengths + 7) // 8
    byte_first = (np.cumsum(nbytes) - nbytes)[tensor] + within // 8
    arrays = [torch.from_numpy(a.astype(np.int64)).to(device) for a in (first, end, byte_first, span_chunks)]
    return count, arrays


def span_stats(x: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(peak float32[T], sum of squares float64[T]) of the spans: per-chunk lanes, per-tensor lanes, totals."""
    count, (first_t, end_t, _, span_t) = _chunk_list(offsets, lengths, x.device)
    sums = torch.empty(count * STATS_LANES, dtype=torch.float64, device=x.device)
    peaks = torch.empty(count * STATS_LANES, dtype=torch.int32, device=x.device)  # read as u32 bits
    lanes, spans = np.int64(STATS_LANES), np.int64(lengths.size)
    work = count * STATS_LANES
    rows = np.int64(STATS_ROWS)
    launch("stats", "cp_stats_chunks", x.device, work, (x, _code(x), first_t, end_t, np.int64(count), lanes, rows, sums, peaks))
    launch("stats", "cp_stats_lanes", x.device, lengths.size * STATS_LANES, (span_t, spans, lanes, sums, peaks))
    sumsq = torch.empty(lengths.size, dtype=torch.float64, device=x.device)
    peak = torch.empty(lengths.size, dtype=torch.float32, device=x.device)
    launch("stats", "cp_stats_total", x.device, lengths.size, (span_t, spans, lanes, sums, peaks, sumsq, peak))
    return peak, sumsq


def sign_pack(
    x: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, error: torch.Tensor | None, acc: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs, float64 sums of |a| per span): the chunk pass, then stats.cu's lane and total passes."""
    count, (first_t, end_t, byte_first_t, span_t) = _chunk_list(offsets, lengths, x.device)
    packed = torch.empty(int(((lengths + 7) // 8).sum()), dtype=torch.uint8, device=x.device)
    sums = torch.empty(count * STATS_LANES, dtype=torch.float64, device=x.device)
    lanes, rows, spans = np.int64(STATS_LANES), np.int64(STATS_ROWS), np.int64(lengths.size)
    feedback = error is not None
    head = (x, _code(x), error if feedback else _NULL, acc if feedback else _NULL, np.int32(feedback))
    args = (*head, first_t, end_t, byte_first_t, np.int64(count), lanes, rows, sums, packed)
    launch("sign", "cp_sign_pack_chunks", x.device, count * (STATS_LANES // 8), args)
    launch("stats", "cp_stats_lanes", x.device, lengths.size * STATS_LANES, (span_t, spans, lanes, sums, _NULL))
    totals = torch.empty(lengths.size, dtype=torch.float64, device=x.device)
    launch("stats", "cp_stats_total", x.device, lengths.size, (span_t, spans, lanes, sums, _NULL, totals, _NULL))
    return packed, totals


def sign_decode(
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: np.ndarray,
    lengths: np.ndarray,
    out: torch.Tensor,
    residual: torch.Tensor | None,
    rank: int,
) -> torch.Tensor:
    world, m = packed.shape
    nbytes = (lengths + 7) // 8
    at = (np.cumsum(nbytes) - nbytes, offsets, lengths)
    packed_at, offsets_t, lengths_t = (torch.from_numpy(a.astype(np.int64)).to(out.device) for a in at)
    feedback = residual is not None
    head = (packed, scales, out, _code(out), residual if feedback else _NULL, np.int32(feedback), np.int32(rank))
    args = (*head, packed_at, offsets_t, lengths_t, np.int64(lengths.size), np.int64(m), np.int32(world))
    launch("sign", "cp_sign_decode", out.device, m, args)
    return out


def quantize_pack(x: torch.Tensor, bits: int, bucket_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    n = x.numel()
    nb = -(-n // bucket_size)
    mins = torch.empty(nb, dtype=torch.float32, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    packed = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=x.device)
    fused = bucket_size * bits % 8 == 0  # every byte within one bucket: packed by the bucket's block
    head = (x, _code(x), np.int64(n), np.int64(bucket_size), np.int32(bits), mins, scales)
    block = min(256, 32 * -(-bucket_size // (32 * SPAN)))  # whole warps, SPAN elements per thread
    args = (*head, packed, np.uint64(seed), np.int32(fused))
    launch("quantize", "cp_bucket_quantize", x.device, nb * block, args, block=block, grid=min(nb, 65535))
    if not fused:
        args = (x, _code(x), mins, scales, packed, np.int64(n), np.int64(bucket_size), np.int32(bits), np.uint64(seed))
        unit = max(8 // bits, 2)  # elements per thread (see cp_quantize_pack)
        launch("quantize", "cp_quantize_pack", x.device, -(-n // unit), args)
    return packed, mins, scales


def unpack_accumulate(
    packed, mins, scales, bits: int, bucket_size: int, n: int, out: torch.Tensor, average: bool
) -> torch.Tensor:
    world, m = packed.shape
    nb = mins.shape[1]
    args = (packed, mins, scales, out, _code(out), np.int64(n), np.int64(m), np.int64(nb), np.int64(bucket_size), np.int32(bits))
    launch("quantize", "cp_unpack_accumulate", out.device, _threads(n), (*args, np.int32(world), _inverse(world, average)))
    return out


def _magnitudes(acc: torch.Tensor) -> torch.Tensor:
    """float32 magnitudes of ``acc``, NaN as +inf (as ``torch.topk`` orders them)."""
    mag = acc.abs()
    if mag.dtype != torch.float32:
        mag = mag.float()
    return torch.nan_to_num_(mag, nan=math.inf, posinf=math.inf)


def _kth_largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-th largest of NaN-free ``mag``, the smallest of its top ``k``: ``torch.kthvalue``
    works within one CUDA thread block and is far slower."""
    return torch.topk(mag, k, sorted=False).values.min()


def exact_threshold(flat: torch.Tensor, k: int) -> float:
    """The ``k``-th largest magnitude of ``flat``."""
    return _kth_largest(_magnitudes(flat), k).item()


def sample_threshold(flat: torch.Tensor, seed: int, sample: int, rank: int) -> float:
    """The ``rank``-th largest magnitude among the ``sample`` entries the CPU's ``sampled_magnitudes`` reads."""
    idx = sample_indices(seed, sample, flat.numel(), flat.device)
    return _kth_largest(_magnitudes(flat[idx]), rank).item()


def select_candidates(flat: torch.Tensor, threshold: float, expect: int) -> tuple[torch.Tensor, None]:
    """Increasing indices of the entries whose magnitude is not below ``threshold`` (NaN included)."""
    return torch.nonzero(~(_magnitudes(flat) < threshold)).view(-1), None


def take_top(flat: torch.Tensor, candidates: torch.Tensor, cvalues: None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and int32 indices of the k largest among increasing ``candidates``, ties to the lower index, zeroed."""
    cmag = _magnitudes(flat[candidates])
    chosen = candidates
    if cmag.numel() > k:
        kth = _kth_largest(cmag, k)
        above = cmag > kth
        ties = cmag == kth
        need = k - int(above.sum())
        chosen = candidates[above | (ties & (torch.cumsum(ties, 0) <= need))]
    return gather_and_zero(flat, chosen)


def gather_and_zero(acc: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values = acc[chosen], acc[chosen] = 0 and int32 indices, in one kernel pass over the k entries."""
    k = chosen.numel()
    values = torch.empty(k, dtype=acc.dtype, device=acc.device)
    idx32 = torch.empty(k, dtype=torch.int32, device=acc.device)
    launch("topk", "cp_gather_and_zero", acc.device, k, (acc, _code(acc), chosen.contiguous(), np.int64(k), values, idx32))
    return values, idx32


def scatter_add_decode(values: torch.Tensor, indices: torch.Tensor, n: int, out: torch.Tensor, average: bool) -> torch.Tensor:
    world, k = values.shape
    in_place = out.dtype == torch.float32  # summed in out itself, else in a float32 buffer
    acc = out.view(-1).zero_() if in_place else torch.zeros(n, dtype=torch.float32, device=out.device)
    for row, idx in zip(values.unbind(0), indices.unbind(0)):  # one launch per rank on one stream: rank order
        launch("topk", "cp_scatter_add_rank", out.device, k, (row, _code(values), idx, np.int64(k), np.int64(n), acc))
    divisor = world if average and world > 1 else 1
    if in_place:  # only the entries that received values need the division
        if divisor > 1:
            seen = torch.zeros(-(-n // 32), dtype=torch.int32, device=out.device)
            args = (indices, np.int64(world * k), np.int64(n), seen, acc, np.int32(divisor))
            launch("topk", "cp_divide_touched", out.device, world * k, args)
    else:
        launch("topk", "cp_finish", out.device, n, (acc, out, _code(out), np.int64(n), np.int32(divisor)))
    return out
