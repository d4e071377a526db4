"""Pack 1-, 2-, 4- or 8-bit codes into ``ceil(n*b/8)`` bytes and back, little-endian: code ``j`` of a
byte at bits ``j*b .. j*b+b-1``, only each code's low ``b`` bits stored, the spare bits zero."""

from __future__ import annotations

import torch

from . import _checks
from ._constants import packed_size
from .cuda import _launch

__all__ = ["pack_bits", "packed_size", "unpack_bits"]

BITS = (1, 2, 4, 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes[n]`` (values below ``2**bits``) into ``uint8[ceil(n*bits/8)]``."""
    _checks.check_dtype("codes", codes, torch.uint8)
    _checks.check_bits(bits, BITS)
    codes = codes.reshape(-1)
    if codes.is_cuda:
        return _launch.pack_bits(codes, bits)
    from .cpu import bitpack

    return bitpack.pack_bits(codes.contiguous(), bits)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes of ``packed`` as ``uint8[n]``."""
    _checks.check_dtype("packed", packed, torch.uint8)
    _checks.check_bits(bits, BITS)
    _checks.check_count("n", n)
    packed = packed.reshape(-1)
    if packed.numel() < packed_size(n, bits):
        raise ValueError(f"packed has {packed.numel()} bytes; {n} codes of {bits} bits need {packed_size(n, bits)}")
    if packed.is_cuda:
        return _launch.unpack_bits(packed, bits, n)
    from .cpu import bitpack

    return bitpack.unpack_bits(packed.contiguous(), bits, n)
