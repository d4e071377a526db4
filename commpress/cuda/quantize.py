"""b-bit uniform quantization with stochastic rounding, one (min, scale) per bucket of B elements.

For bucket ``j`` with ``lo = min``, ``hi = max`` (each plus 0.0, so a zero is always +0) and
``scale = (hi - lo) / (2**b - 1)``, element ``i`` gets code
``q = floor((x_i - lo) / scale + u_i)`` clamped to ``[0, 2**b - 1]``, with ``u = uniform(seed,
n)``; so ``E[lo + q * scale] = x_i`` (unbiased). A NaN ``q`` (NaN in the bucket, or ``0 / 0``)
becomes 0, and a bucket whose scale is 0 gets all-zero codes. Every step is one IEEE float32
operation (no fused multiply-add), which the CUDA kernels repeat exactly.

Decoding is ``lo + q * scale`` (multiply, then add); the accumulating decode sums the ranks in
rank order in float32 and divides by the number of ranks.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import _backend, _checks, _chunks, bitpack, rng

__all__ = ["dequantize", "quantize_pack", "unpack_accumulate"]

BITS = (2, 4, 8)


def _groups(n: int, bucket_size: int, bits: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into runs of whole buckets (about CHUNK elements) starting on a byte."""
    align = 8 // math.gcd(bucket_size * bits, 8)
    rows = max(1, _chunks.CHUNK // bucket_size)
    rows = -(-rows // align) * align
    step = rows * bucket_size
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def _bucket_view(a: np.ndarray, bucket_size: int) -> list[np.ndarray]:
    """``a`` as a 2-D [rows, B] view of its whole buckets, plus the partial last one (if any)."""
    full = a.size - a.size % bucket_size
    parts = [a[:full].reshape(-1, bucket_size)] if full else []
    if full < a.size:
        parts.append(a[full:].reshape(1, -1))
    return parts


@np.errstate(invalid="ignore", divide="ignore")  # 0 / 0 and NaN are defined to give code 0
def _quantize_group(x: np.ndarray, levels: int, seed: int, offset: int, bucket_size: int):
    """Codes (uint8), mins and scales (float32) of the buckets that make up block ``x``."""
    u = np.empty(x.size, np.float32)
    rng.fill_uniform(u, seed, offset)
    codes = np.empty(x.size, np.uint8)
    mins, scales = [], []
    for xb, ub, cb in zip(_bucket_view(x, bucket_size), _bucket_view(u, bucket_size), _bucket_view(codes, bucket_size)):
        lo = xb.min(axis=1) + np.float32(0.0)
        hi = xb.max(axis=1) + np.float32(0.0)
        scale = (hi - lo) / np.float32(levels)
        t = xb - lo[:, None]
        t /= scale[:, None]
        t += ub
        np.fmax(t, np.float32(0.0), out=t)  # fmax maps NaN to 0
        np.minimum(t, np.float32(levels), out=t)
        cb[...] = t  # truncation is floor here: 0 <= t <= levels
        cb[scale == 0] = 0
        mins.append(lo)
        scales.append(scale)
    return codes, np.concatenate(mins), np.concatenate(scales)


def _check_layout(bits: int, bucket_size: int) -> None:
    _checks.check_bits(bits, BITS)
    _checks.check_count("bucket_size", bucket_size, 1)


def quantize_pack(x: torch.Tensor, bits: int, bucket_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize flat ``x`` to ``bits``-bit codes per bucket of ``bucket_size``; pack them.

    Returns ``(packed uint8[ceil(n*bits/8)], mins float32[nb], scales float32[nb])`` with
    ``nb = ceil(n / bucket_size)``. ``x`` may be float32, float16 or bfloat16.
    """
    _checks.check_float("x", x)
    _check_layout(bits, bucket_size)
    seed = rng._check_seed(seed)
    x = x.reshape(-1)
    if x.is_cuda:
        from . import _launch

        return _launch.quantize_pack(x, bits, bucket_size, seed)
    x = x.contiguous()
    n = x.numel()
    nb = -(-n // bucket_size)
    packed = torch.empty(bitpack.packed_size(n, bits), dtype=torch.uint8)
    mins = torch.empty(nb, dtype=torch.float32)
    scales = torch.empty(nb, dtype=torch.float32)
    kernels = _backend.compiled()
    if kernels is not None:
        kernels.quantize_pack(x, bits, bucket_size, seed, packed, mins, scales)
        return packed, mins, scales
    dst, mins_np, scales_np = _chunks.as_numpy(packed), _chunks.as_numpy(mins), _chunks.as_numpy(scales)
    levels = (1 << bits) - 1

    def body(start: int, stop: int) -> None:
        codes, lo, scale = _quantize_group(_chunks.float32_block(x, start, stop), levels, seed, start, bucket_size)
        first = start // bucket_size
        mins_np[first : first + lo.size] = lo
        scales_np[first : first + lo.size] = scale
        bitpack.pack_np(codes, bits, dst[start * bits // 8 : bitpack.packed_size(stop, bits)])

    _chunks.map_blocks(body, _groups(n, bucket_size, bits))
    return packed, mins, scales


# byte -> the float codes it holds (decoding is one gather per byte)
_CODE_TABLES = {
    bits: ((np.arange(256)[:, None] >> (bits * np.arange(8 // bits))) & ((1 << bits) - 1)).astype(np.float32)
    for bits in (2, 4, 8)
}


@np.errstate(invalid="ignore")  # 0 * inf in a bucket of infinities is NaN, as on the GPU
def _decode_group(
    packed: np.ndarray, mins: np.ndarray, scales: np.ndarray, bits: int, bucket_size: int, count: int
) -> np.ndarray:
    """float32 values of ``count`` elements (whole buckets from a byte boundary) of one rank."""
    values = np.take(_CODE_TABLES[bits], packed, axis=0).reshape(-1)[:count]
    first = 0
    for vb in _bucket_view(values, bucket_size):
        rows = vb.shape[0]
        vb *= scales[first : first + rows, None]
        vb += mins[first : first + rows, None]
        first += rows
    return values


def _check_payload(packed, mins, scales, bits, bucket_size, n, world: int | None) -> None:
    _checks.check_dtype("packed", packed, torch.uint8)
    _checks.check_dtype("mins", mins, torch.float32)
    _checks.check_dtype("scales", scales, torch.float32)
    _check_layout(bits, bucket_size)
    _checks.check_count("n", n)
    lead = () if world is None else (world,)
    nb = -(-n // bucket_size)
    _checks.check_shape("packed", packed, (*lead, bitpack.packed_size(n, bits)))
    _checks.check_shape("mins", mins, (*lead, nb))
    _checks.check_shape("scales", scales, (*lead, nb))


def _check_out(out: torch.Tensor, n: int) -> None:
    _checks.check_float("out", out)
    if out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of {n} elements, got shape {tuple(out.shape)}")


def dequantize(
    packed: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    bucket_size: int,
    n: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode one rank's payload: ``lo + q * scale`` per element, into ``out`` (float32 by default)."""
    _check_payload(packed, mins, scales, bits, bucket_size, n, None)
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
    _check_out(out, n)
    return unpack_accumulate(
        packed.unsqueeze(0), mins.unsqueeze(0), scales.unsqueeze(0), bits, bucket_size, n, out, average=False
    )


def unpack_accumulate(
    packed: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    bucket_size: int,
    n: int,
    out: torch.Tensor,
    average: bool = True,
) -> torch.Tensor:
    """``out = sum_r decode(rank r) (/ world)``, summed in rank order in float32; returns ``out``.

    ``packed`` uint8[world, ceil(n*bits/8)], ``mins``/``scales`` float32[world, nb]; ``out``
    (float32/float16/bfloat16, ``n`` elements) is overwritten.
    """
    if packed.dim() != 2:
        raise ValueError(f"packed must be 2-D [world, bytes], got shape {tuple(packed.shape)}")
    world = packed.shape[0]
    if world < 1:
        raise ValueError("packed must hold at least one rank")
    _check_payload(packed, mins, scales, bits, bucket_size, n, world)
    _check_out(out, n)
    _checks.check_same_device(packed=packed, mins=mins, scales=scales, out=out)
    if out.is_cuda:
        from . import _launch

        return _launch.unpack_accumulate(
            packed.contiguous(), mins.contiguous(), scales.contiguous(), bits, bucket_size, n, out, average
        )
    packed, mins, scales = packed.contiguous(), mins.contiguous(), scales.contiguous()
    kernels = _backend.compiled()
    if kernels is not None:
        kernels.unpack_accumulate(packed, mins, scales, bits, bucket_size, n, out, average)
        return out
    src = _chunks.as_numpy(packed)
    mins_np, scales_np = _chunks.as_numpy(mins), _chunks.as_numpy(scales)
    flat = out.view(-1)
    divisor = np.float32(world)

    def body(start: int, stop: int) -> None:
        lo, hi = start * bits // 8, bitpack.packed_size(stop, bits)
        first, last = start // bucket_size, -(-stop // bucket_size)
        acc = _decode_group(src[0, lo:hi], mins_np[0, first:last], scales_np[0, first:last], bits, bucket_size, stop - start)
        for r in range(1, world):
            acc += _decode_group(src[r, lo:hi], mins_np[r, first:last], scales_np[r, first:last], bits, bucket_size, stop - start)
        if average and world > 1:
            acc /= divisor
        _chunks.write_block(flat, start, acc)

    _chunks.map_blocks(body, _groups(n, bucket_size, bits))
    return out
