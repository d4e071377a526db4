"""Several tensors in one uint8 buffer, so a bucket's payload travels in ONE all-gather, not one
collective per piece (codes, indices and values cannot be summed, so they are gathered)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["frame", "framed_nbytes", "unframe"]


def frame(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of every piece (any dtype, flattened), end to end, as one uint8 tensor."""
    if not pieces:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([p.detach().contiguous().reshape(-1).view(torch.uint8) for p in pieces])


def framed_nbytes(layout: Sequence[tuple[torch.dtype, int]]) -> int:
    """Size in bytes of a frame holding ``count`` elements of ``dtype`` per entry."""
    return sum(dtype.itemsize * count for dtype, count in layout)


def unframe(frames: Sequence[torch.Tensor], layout: Sequence[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Cut each rank's frame into the pieces ``layout`` lists (dtype, count), each a contiguous
    ``[world, count]`` tensor with row ``r`` from rank ``r``."""
    expected = framed_nbytes(layout)
    for rank, f in enumerate(frames):
        if f.dtype != torch.uint8 or f.numel() != expected:
            raise ValueError(f"frame of rank {rank} has {f.numel()} {f.dtype} elements, expected {expected} uint8")
    out, start = [], 0
    for dtype, count in layout:
        end = start + dtype.itemsize * count
        if count and frames:
            out.append(torch.stack([f.narrow(0, start, end - start) for f in frames]).view(dtype))
        else:
            out.append(torch.empty(len(frames), count, dtype=dtype, device=frames[0].device if frames else None))
        start = end
    return out
