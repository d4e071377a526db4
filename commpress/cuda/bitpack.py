"""Pack small integer codes into bytes and back (1, 2, 4 or 8 bits per code).

Layout (little-endian inside a byte): code ``j`` of a byte sits at bits ``j*b .. j*b+b-1``;
codes are stored in order, ``ceil(n*b/8)`` bytes, the unused high bits of the last byte are
zero. Only the low ``b`` bits of each code are stored.

CPU path: eight codes form one uint64 word and three shift/or/mask steps gather their low
bits into ``b`` bytes (and three steps spread them back), so the work is a handful of ufuncs
per eight codes.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _backend, _checks, _chunks
from ._constants import packed_size

__all__ = ["pack_bits", "packed_size", "unpack_bits"]

BITS = (1, 2, 4, 8)


def _lanes(width: int, lane: int) -> np.uint64:
    """A uint64 with the low ``width`` bits of every ``lane``-bit lane set."""
    field = (1 << width) - 1
    return np.uint64(sum(field << s for s in range(0, 64, lane)))


# For b bits: (shift, mask) of the three gather steps; spreading runs them backwards.
_STEPS = {b: [(8 - b, _lanes(2 * b, 16)), (16 - 2 * b, _lanes(4 * b, 32)), (32 - 4 * b, _lanes(8 * b, 64))] for b in (1, 2, 4)}
_LOW = {b: _lanes(b, 8) for b in (1, 2, 4, 8)}


def pack_np(codes: np.ndarray, bits: int, out: np.ndarray) -> None:
    """Pack uint8 ``codes`` (any length) into ``out`` (``packed_size(len(codes), bits)`` bytes)."""
    n = codes.size
    full = n - n % 8
    if full:
        w = np.bitwise_and(codes[:full].view(np.uint64), _LOW[bits])
        if bits == 8:
            out[:full] = w.view(np.uint8)
        else:
            t = np.empty_like(w)
            for shift, mask in _STEPS[bits]:
                np.right_shift(w, np.uint64(shift), out=t)
                w |= t
                w &= mask
            out[: full * bits // 8].reshape(-1, bits)[...] = w.view(np.uint8).reshape(-1, 8)[:, :bits]
    if full < n:
        tail = np.zeros(8, np.uint8)
        tail[: n - full] = codes[full:]
        packed = np.empty(bits, np.uint8)
        pack_np(tail, bits, packed)
        out[full * bits // 8 :] = packed[: out.size - full * bits // 8]


def unpack_np(packed: np.ndarray, bits: int, out: np.ndarray) -> None:
    """Unpack ``out.size`` codes from ``packed`` into uint8 ``out``."""
    n = out.size
    full = n - n % 8
    if full:
        nw = full // 8
        if bits == 8:
            out[:full] = packed[:full]
        else:
            buf = np.zeros((nw, 8), np.uint8)
            buf[:, :bits] = packed[: nw * bits].reshape(nw, bits)
            w = buf.view(np.uint64).reshape(nw)
            t = np.empty_like(w)
            masks = [_LOW[bits]] + [mask for _, mask in _STEPS[bits][:-1]]
            for (shift, _), mask in zip(reversed(_STEPS[bits]), reversed(masks)):
                np.left_shift(w, np.uint64(shift), out=t)
                w |= t
                w &= mask
            out[:full] = w.view(np.uint8)
    if full < n:
        tail = np.zeros(bits, np.uint8)
        src = packed[full * bits // 8 :]
        tail[: src.size] = src
        codes = np.empty(8, np.uint8)
        unpack_np(tail, bits, codes)
        out[full:] = codes[: n - full]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes[n]`` (values below ``2**bits``) into ``uint8[ceil(n*bits/8)]``."""
    _checks.check_dtype("codes", codes, torch.uint8)
    _checks.check_bits(bits, BITS)
    codes = codes.reshape(-1)
    if codes.is_cuda:
        from . import _launch

        return _launch.pack_bits(codes, bits)
    codes = codes.contiguous()
    kernels = _backend.compiled()
    if kernels is not None:
        return kernels.pack_bits(codes, bits)
    n = codes.numel()
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8)
    src, dst = _chunks.as_numpy(codes), _chunks.as_numpy(out)
    step = _chunks.CHUNK
    _chunks.run(n, lambda s, e: pack_np(src[s:e], bits, dst[s * bits // 8 : packed_size(e, bits)]), step)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes of ``packed`` as ``uint8[n]``."""
    _checks.check_dtype("packed", packed, torch.uint8)
    _checks.check_bits(bits, BITS)
    _checks.check_count("n", n)
    packed = packed.reshape(-1)
    if packed.numel() < packed_size(n, bits):
        raise ValueError(f"packed has {packed.numel()} bytes; {n} codes of {bits} bits need {packed_size(n, bits)}")
    if packed.is_cuda:
        from . import _launch

        return _launch.unpack_bits(packed, bits, n)
    packed = packed.contiguous()
    kernels = _backend.compiled()
    if kernels is not None:
        return kernels.unpack_bits(packed, bits, n)
    out = torch.empty(n, dtype=torch.uint8)
    src, dst = _chunks.as_numpy(packed), _chunks.as_numpy(out)
    _chunks.run(n, lambda s, e: unpack_np(src[s * bits // 8 : packed_size(e, bits)], bits, dst[s:e]))
    return out
