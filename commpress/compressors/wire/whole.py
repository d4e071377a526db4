"""Small tensors sent whole: the part of a gathered payload that is averaged exactly.

Biases and norm weights hold few of the bytes but shape training out of proportion, so the
gathering compressors send tensors under ``min_numel`` whole in float32, in the same all-gather
(docs/quantization.md, "Small tensors").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch

from commpress.compressors.base import Bucket, ParamSlot, lay_out
from commpress.compressors.wire.collectives import sum_rows
from commpress.compressors.wire.memory import Piece
from commpress.compressors.wire.seeding import tensor_key
from commpress.schema import Bounds

__all__ = ["DEFAULT_MIN_NUMEL", "MinNumel", "average_whole", "split_whole", "whole_part", "write_whole"]

#: Tensors smaller than this are sent whole by default.
DEFAULT_MIN_NUMEL = 1024
#: A compressor's ``min_numel`` parameter: tensors of fewer elements are sent whole.
MinNumel = Annotated[int, Bounds(ge=0, note="0: compress every tensor")]


def split_whole(slots: Sequence[ParamSlot], min_numel: int) -> tuple[list[ParamSlot], list[ParamSlot]]:
    """(the slots compressed, the slots sent whole: fewer than ``min_numel`` elements)."""
    return [s for s in slots if s.numel >= min_numel], [s for s in slots if s.numel < min_numel]


def whole_part(grad: torch.Tensor, bucket: Bucket, whole: Sequence[ParamSlot]) -> tuple[torch.Tensor, list[Piece]]:
    """The tensors sent whole, end to end in float32, and their pieces in that layout."""
    laid, _ = lay_out((tensor_key(bucket, s), s.shape) for s in whole)
    pieces = [(p.name, p.offset, tuple(p.shape)) for p in laid]
    if not whole:
        return grad.new_empty(0, dtype=torch.float32), pieces
    return torch.cat([grad.narrow(0, s.offset, s.numel) for s in whole]).to(torch.float32), pieces


def average_whole(gathered: torch.Tensor) -> torch.Tensor:
    """The average of every rank's whole part (``[world, d]`` float32), summed in rank order."""
    return sum_rows(gathered).div_(gathered.shape[0])


def write_whole(buffer: torch.Tensor, whole: Sequence[ParamSlot], pieces: Sequence[Piece], average: torch.Tensor) -> None:
    """Copy each whole tensor's ``average`` (the layout of :func:`whole_part`) into ``buffer``."""
    for slot, (_, offset, _) in zip(whole, pieces, strict=True):
        buffer.narrow(0, slot.offset, slot.numel).copy_(average.narrow(0, offset, slot.numel))
