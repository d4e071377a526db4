"""Bit packing on the CPU (numba): codes of 1, 2, 4 or 8 bits, little-endian inside a byte."""

from __future__ import annotations

import torch

from commpress.kernels._constants import packed_size

from . import _chunks
from ._jit import inline, jit

__all__ = ["pack_bits", "unpack_bits"]


@inline
def pack_fixed(codes, out, per, bits):
    """Pack ``codes`` at ``per`` codes of ``bits`` bits per byte into ``out``."""
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


@jit
def pack(codes, bits, out):
    """Pack uint8 ``codes`` (any length) into ``out`` (``ceil(len * bits / 8)`` bytes)."""
    if bits == 1:
        pack_fixed(codes, out, 8, 1)
    elif bits == 2:
        pack_fixed(codes, out, 4, 2)
    elif bits == 4:
        pack_fixed(codes, out, 2, 4)
    else:
        pack_fixed(codes, out, 1, 8)


@inline
def _unpack_fixed(packed, out, per, bits):
    mask = (1 << bits) - 1
    for i in range(out.size):
        out[i] = (packed[i // per] >> ((i % per) * bits)) & mask


@jit
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


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack contiguous uint8 ``codes`` into ``uint8[ceil(n*bits/8)]``."""
    n = codes.numel()
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8)
    src, dst = _chunks.as_numpy(codes), _chunks.as_numpy(out)
    _chunks.map_blocks(lambda s, e: pack(src[s:e], bits, dst[s * bits // 8 :]), _chunks.parts(n, 8))
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first ``n`` codes of contiguous ``packed`` as ``uint8[n]``."""
    out = torch.empty(n, dtype=torch.uint8)
    src, dst = _chunks.as_numpy(packed), _chunks.as_numpy(out)
    _chunks.map_blocks(lambda s, e: unpack(src[s * bits // 8 :], bits, dst[s:e]), _chunks.parts(n, 8))
    return out
