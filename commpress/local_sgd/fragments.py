"""Streaming DiLoCo's fragments: the flat model cut into F contiguous pieces of whole tensors,
fragment ``f`` ending at the tensor boundary nearest ``(f + 1) / F`` of the elements (the later
one on a tie), none empty, so a tensor over ``1 / F`` of the model enlarges its fragment."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from commpress.compressors import Bucket, ParamSlot
from commpress.errors import ConfigError

__all__ = ["Fragment", "split"]


@dataclass(frozen=True)
class Fragment:
    """Elements ``[start, stop)`` of the flat model and the slots of its tensors, their
    offsets counted from ``start`` (a bucket of the fragment's own values)."""

    index: int
    start: int
    stop: int
    slots: tuple[ParamSlot, ...]
    tensors: range  # the model's tensors it holds, by position

    @property
    def where(self) -> slice:
        return slice(self.start, self.stop)

    def bucket(self, buffer: torch.Tensor) -> Bucket:
        """``buffer`` (this fragment's values) as bucket ``index``: compressors key their
        state on the slot names, which no two fragments share."""
        return Bucket(self.index, buffer, self.slots)


def split(
    slots: tuple[ParamSlot, ...], fragments: int, who: str = "DiLoCo", sizes: Sequence[int] | None = None
) -> tuple[Fragment, ...]:
    """``slots`` (a flat model's, in order) cut into ``fragments`` fragments; ``who`` names the
    caller in errors. ``sizes``: the whole tensors' sizes to cut a shard's slots by, so every
    shard cuts at the same tensors."""
    if not 1 <= fragments <= len(slots):
        raise ConfigError(
            f"{who}: fragments = {fragments!r} is not accepted for a model of {len(slots)} tensors; expected an integer "
            f"from 1 to {len(slots)} (a fragment holds whole tensors)"
        )
    ends = list(itertools.accumulate(sizes if sizes is not None else [s.numel for s in slots]))
    total = ends[-1]
    bounds = [0]
    for f in range(1, fragments):
        target = total * f / fragments
        # the boundary nearest the target, after the previous cut, leaving a tensor per later fragment
        lo, hi = bounds[-1] + 1, len(slots) - (fragments - f)
        bounds.append(min(range(lo, hi + 1), key=lambda i: (abs(ends[i - 1] - target), -i)))
    bounds.append(len(slots))
    out = []
    for f, (a, b) in enumerate(itertools.pairwise(bounds)):
        start = slots[a].offset
        members = tuple(ParamSlot(s.name, s.shape, s.offset - start) for s in slots[a:b])
        out.append(Fragment(f, start, slots[b - 1].offset + slots[b - 1].numel, members, range(a, b)))
    return tuple(out)
