"""The bytes one rank sends for one FSDP flat shard: quantized parts and full-precision parts.

A flat shard is split into *quantized* ranges, coded by :mod:`commpress.kernels` in buckets of
``bucket_size``, and *raw* ranges (excluded parameters). One payload is::

    scales (float32 x nb) | mins (float32 x nb) | raw elements (shard dtype) | packed codes | pad

padded to 4 bytes so gathered ``[world, nbytes]`` rows view as float32 without copies. Gradient
payloads leave raw elements out (``carry_raw=False``): the ordinary reduce-scatter sums them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from commpress.kernels import dequantize, quantize_pack, unpack_accumulate

__all__ = ["Segments", "Wire"]


@dataclass(frozen=True)
class Segments:
    """Which ranges ``(offset, length)`` of a flat shard of ``n`` elements are quantized."""

    n: int
    quantized: tuple[tuple[int, int], ...]

    @cached_property
    def raw(self) -> tuple[tuple[int, int], ...]:
        """The complement of :attr:`quantized`: ranges kept in full precision."""
        out, pos = [], 0
        for offset, length in self.quantized:
            if offset > pos:
                out.append((pos, offset - pos))
            pos = offset + length
        if pos < self.n:
            out.append((pos, self.n - pos))
        return tuple(out)

    @property
    def nq(self) -> int:
        return sum(length for _, length in self.quantized)

    @property
    def nraw(self) -> int:
        return self.n - self.nq

    def take(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """The elements of ``which`` ("quantized" or "raw") ranges along the last dim of ``x``."""
        ranges = self.quantized if which == "quantized" else self.raw
        if len(ranges) == 1 and ranges[0] == (0, self.n):
            return x
        return torch.cat([x.narrow(-1, o, n) for o, n in ranges], dim=-1)

    def put(self, out: torch.Tensor, values: torch.Tensor, which: str) -> None:
        """Write ``values`` (as from :meth:`take`) back into ``which`` ranges of ``out``."""
        ranges = self.quantized if which == "quantized" else self.raw
        pos = 0
        for o, n in ranges:
            out.narrow(-1, o, n).copy_(values.narrow(-1, pos, n))
            pos += n


class Wire:
    """Encodes and decodes one payload for :class:`Segments` at ``bits`` bits."""

    def __init__(self, segments: Segments, bits: int, bucket_size: int, dtype: torch.dtype, carry_raw: bool = True) -> None:
        self.segments = segments
        self.carry_raw = carry_raw
        self.bits = bits
        self.bucket_size = bucket_size
        self.dtype = dtype
        nq = segments.nq
        self.buckets = math.ceil(nq / bucket_size)
        self.packed_bytes = math.ceil(nq * bits / 8)
        self.raw_bytes = segments.nraw * torch.empty((), dtype=dtype).element_size() if carry_raw else 0
        self._raw_at = 8 * self.buckets
        self._packed_at = self._raw_at + self.raw_bytes
        #: bytes of one payload (padded to a multiple of 4)
        self.nbytes = 4 * math.ceil((self._packed_at + self.packed_bytes) / 4)

    def _parts(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scales, mins, raw, packed) views of ``payload`` (``[..., nbytes]`` uint8)."""
        nb = self.buckets
        # narrow, not slicing: it also works on fake CUDA tensors (the device tests)
        scales = payload.narrow(-1, 0, 4 * nb).view(torch.float32)
        mins = payload.narrow(-1, 4 * nb, 4 * nb).view(torch.float32)
        raw = payload.narrow(-1, self._raw_at, self.raw_bytes).view(self.dtype)
        packed = payload.narrow(-1, self._packed_at, self.packed_bytes)
        return scales, mins, raw, packed

    def encode(self, x: torch.Tensor, seed: int, payload: torch.Tensor) -> None:
        """Encode flat ``x`` into ``payload`` (uint8[nbytes])."""
        scales, mins, raw_part, packed = self._parts(payload)
        if self.segments.nq:
            p, lo, sc = quantize_pack(self.segments.take(x, "quantized"), self.bits, self.bucket_size, seed)
            packed.copy_(p)
            mins.copy_(lo)
            scales.copy_(sc)
        if self.carry_raw and self.segments.nraw:
            raw_part.copy_(self.segments.take(x, "raw"))
        end = self._packed_at + self.packed_bytes
        payload.narrow(-1, end, payload.shape[-1] - end).zero_()

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Write the dequantized and raw elements of one payload into flat ``out``."""
        scales, mins, raw_part, packed = self._parts(payload)
        if self.segments.nq:
            values = dequantize(packed, mins, scales, self.bits, self.bucket_size, self.segments.nq)
            self.segments.put(out, values, "quantized")
        if self.carry_raw and self.segments.nraw:
            self.segments.put(out, raw_part, "raw")

    def accumulate(self, payloads: torch.Tensor, out: torch.Tensor, average: bool) -> None:
        """Sum (or average) the quantized ranges of ``payloads`` (``[world, nbytes]``) into ``out``."""
        if not self.segments.nq:
            return
        scales, mins, _, packed = self._parts(payloads)
        nq = self.segments.nq
        whole = self.segments.quantized == ((0, self.segments.n),) and out.is_contiguous()
        target = out if whole else torch.empty(nq, dtype=out.dtype, device=out.device)
        unpack_accumulate(
            packed.contiguous(), mins.contiguous(), scales.contiguous(), self.bits, self.bucket_size, nq, target, average=average
        )
        if not whole:
            self.segments.put(out, target, "quantized")
