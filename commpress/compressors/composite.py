"""One bucket, several methods (config overrides, a skipped last layer): each group's part is
reduced in turn, on a gathered copy scattered back unless it is the whole buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from commpress.compressors.base import Bucket, Compressor, Context, Finite, ParamSlot, Reduction

__all__ = ["Composite", "Part"]


@dataclass(frozen=True)
class Part:
    """The slots of one bucket that share a method group."""

    key: str
    slots: tuple[ParamSlot, ...]
    whole: bool  # the part covers the whole buffer, in order: no gather/scatter needed


class Composite:
    """Reduces buckets with each parameter in the group ``key_for(name)`` names; ``compressors``
    (group key -> compressor) is read at every reduction, so a group may change compressor."""

    def __init__(self, key_for: Callable[[str], str], compressors: Mapping[str, Compressor]) -> None:
        self.key_for = key_for
        self.compressors = compressors
        self._parts: dict[tuple[ParamSlot, ...], tuple[Part, ...]] = {}

    @property
    def rounds(self) -> int:
        """Collectives one bucket may need: its groups run one after another."""
        return sum(c.rounds for c in self.compressors.values())

    def parts(self, slots: tuple[ParamSlot, ...]) -> tuple[Part, ...]:
        """``slots`` split by group, in order of first appearance (cached per layout)."""
        cached = self._parts.get(slots)
        if cached is None:
            groups: dict[str, list[ParamSlot]] = {}
            for slot in slots:
                groups.setdefault(self.key_for(slot.name), []).append(slot)
            whole = len(groups) == 1
            cached = self._parts[slots] = tuple(Part(key, tuple(members), whole) for key, members in groups.items())
        return cached

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        """Each group's reduction in turn; the average is known finite when every group's is."""
        known: list[Finite] = []
        for part in self.parts(tuple(bucket.slots)):
            compressor = self.compressors[part.key]
            if part.whole:
                known.append((yield from compressor.reduce(Bucket(bucket.index, bucket.buffer, part.slots), ctx)))
                continue
            views = [bucket.buffer.narrow(0, s.offset, s.numel).view(s.shape) for s in part.slots]
            local = Bucket.from_tensors(bucket.index, views, [s.name for s in part.slots])
            known.append((yield from compressor.reduce(local, ctx)))
            for view, out in zip(views, local.views()):
                view.copy_(out)
        return _combined(known)


def _combined(known: list[Finite]) -> Finite:
    """Whether the parts' averages are all finite: False if one is not, None if one is unknown."""
    if False in known:
        return False
    return True if known and None not in known else None
