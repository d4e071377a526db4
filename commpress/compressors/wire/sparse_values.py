"""Top-k's selected values on the wire as b-bit codes (SparseLoCo's "top-k + 2-bit" payload).

Each tensor's selection is quantized stochastically (:mod:`commpress.kernels`) with one float32
(min, scale) per tensor and rank, its codes starting on a byte. Per tensor, not per DDP bucket,
so ranges and random numbers do not depend on the bucketing (a resumed run continues bit for bit).

Wire bytes per tensor: ``ceil(k * bits / 8) + 8`` (and Top-k's 4-byte index per value).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commpress.kernels import packed_size, quantize_pack, unpack_bits

__all__ = ["ValueCodec"]

_CACHED = 16


class ValueCodec:
    """Encodes one rank's selected values per tensor, decodes every rank's."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        # per (counts, device): each value's code position and its tensor (hence its min and scale)
        self._index: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def nbytes(self, k: int) -> int:
        """Wire bytes of one tensor's ``k`` values: packed codes and a float32 (min, scale)."""
        return packed_size(k, self.bits) + 8 if k else 0

    def layout(self, counts: Sequence[int]) -> list[tuple[torch.dtype, int]]:
        """The frame pieces (dtype, count): mins, scales (one per tensor), packed codes."""
        packed = sum(packed_size(k, self.bits) for k in counts)
        return [(torch.float32, len(counts)), (torch.float32, len(counts)), (torch.uint8, packed)]

    def encode(
        self, values: torch.Tensor, counts: Sequence[int], seeds: Sequence[int]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Quantize ``values`` (``counts[t]`` per tensor, end to end, keyed by ``seeds[t]``): the frame
        pieces of :meth:`layout` and what they decode to."""
        if not counts:
            empty = values.new_empty(0)
            return [empty, empty, empty.to(torch.uint8)], empty
        parts = values.split(list(counts))
        packed, mins, scales = zip(*(quantize_pack(v, self.bits, k, s) for v, k, s in zip(parts, counts, seeds, strict=True)))
        pieces = [torch.cat(mins), torch.cat(scales), torch.cat(packed)]
        return pieces, self.decode(*(p.unsqueeze(0) for p in pieces), counts).select(0, 0)

    def decode(self, mins: torch.Tensor, scales: torch.Tensor, packed: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Every rank's values, float32 ``[world, k]``: ``lo + q * scale`` (multiply, then add, like the quantizer)."""
        world, nbytes = packed.shape
        if not counts:  # every tensor of the bucket went whole: no values
            return packed.new_empty(world, 0, dtype=torch.float32)
        per = 8 // self.bits
        codes = unpack_bits(packed.reshape(-1), self.bits, world * nbytes * per).view(world, nbytes * per)
        where, which = self._where(tuple(counts), packed.device)
        q = codes.index_select(1, where).to(torch.float32)
        return q.mul_(scales.index_select(1, which)).add_(mins.index_select(1, which))

    def _where(self, counts: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(code position in a rank's unpacked bytes, tensor index) of every value."""
        key = (counts, device)
        if key not in self._index:
            if len(self._index) >= _CACHED:  # counts change during a warm-up: keep the latest few
                self._index.clear()
            per, start, where, which = 8 // self.bits, 0, [], []
            for t, k in enumerate(counts):
                where.append(torch.arange(start, start + k, dtype=torch.int64, device=device))
                which.append(torch.full((k,), t, dtype=torch.int64, device=device))
                start += packed_size(k, self.bits) * per
            self._index[key] = (torch.cat(where), torch.cat(which))
        return self._index[key]
