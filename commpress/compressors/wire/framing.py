"""Several tensors in one uint8 buffer, so a bucket's payload travels in ONE all-gather.

Payloads that cannot be summed (packed codes, sparse values and indices) are gathered;
gathering each piece separately would cost one collective per piece. :func:`frame`
lays the raw bytes of the pieces end to end; :func:`unframe` cuts every rank's gathered
buffer back into the pieces, stacked over ranks.
"""

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
    """Cut each rank's frame into pieces; piece ``j`` comes back as a contiguous
    ``[world, count_j]`` tensor of ``dtype_j`` (row ``r`` from rank ``r``).

    ``layout`` lists (dtype, element count) of the pieces in framing order; every frame
    must be exactly :func:`framed_nbytes` long.
    """
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
