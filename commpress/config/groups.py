"""A model's method groups: the config's main method and each override, the compressor
that runs each, and which parameters each covers.

One object serves every user of groups (the DDP hook state, the bandwidth-aware layer,
Local SGD's averager), so group keys (``"main"``, ``"override0"``, ...), rounds and the
split of a bucket into groups are defined once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from commpress.compressors import Bucket, Compressor, Context, ParamSlot, Reduction, build
from commpress.config import Config

__all__ = ["MAIN", "MethodGroups", "Part"]

#: The key of the config's top-level method.
MAIN = "main"


@dataclass(frozen=True)
class Part:
    """The slots of one bucket that share a method group."""

    key: str
    slots: tuple[ParamSlot, ...]
    whole: bool  # the part covers the whole buffer, in order: no gather/scatter needed


class MethodGroups:
    """The method groups of ``config``, each with its compressor."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.specs: dict[str, tuple[str, dict[str, Any]]] = {MAIN: (config.method, dict(config.params))}
        for i, ov in enumerate(config.overrides):
            self.specs[f"override{i}"] = (ov.method, dict(ov.method_params))
        self.compressors: dict[str, Compressor] = {key: build(m, p) for key, (m, p) in self.specs.items()}
        self._parts: dict[tuple[ParamSlot, ...], tuple[Part, ...]] = {}

    @property
    def rounds(self) -> int:
        """Collectives one bucket may need: its groups run one after another."""
        return sum(c.rounds for c in self.compressors.values())

    def key_for(self, name: str) -> str:
        """The group of the parameter called ``name`` (first matching override wins)."""
        for i, ov in enumerate(self.config.overrides):
            if ov.matches(name):
                return f"override{i}"
        return MAIN

    def replace(self, key: str, compressor: Compressor) -> None:
        """Run group ``key`` with ``compressor`` from now on (the bandwidth layer changes a
        method's parameter this way)."""
        self.compressors[key] = compressor

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

    def reduction(self, bucket: Bucket, ctx: Context) -> Reduction:
        """Each group's reduction of ``bucket`` in turn; a group that is not the whole
        buffer works on a gathered copy that is scattered back afterwards."""
        for part in self.parts(tuple(bucket.slots)):
            compressor = self.compressors[part.key]
            if part.whole:
                yield from compressor.reduce(Bucket(bucket.index, bucket.buffer, part.slots), ctx)
                continue
            views = [bucket.buffer.narrow(0, s.offset, s.numel) for s in part.slots]
            local = Bucket.from_tensors(
                bucket.index, [v.view(s.shape) for v, s in zip(views, part.slots)], [s.name for s in part.slots]
            )
            yield from compressor.reduce(local, ctx)
            for view, out in zip(views, _flat_views(local)):
                view.copy_(out)

    def end_step(self, commit: bool) -> None:
        """Commit (or, for a non-finite step, discard) every group's staged state."""
        for compressor in self.compressors.values():
            compressor.end_step(commit)

    def state_dict(self) -> dict[str, Any]:
        return {key: c.state_dict() for key, c in self.compressors.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, c in self.compressors.items():
            c.load_state_dict(state.get(key, {}))


def _flat_views(bucket: Bucket) -> Iterator:
    for s in bucket.slots:
        yield bucket.buffer.narrow(0, s.offset, s.numel)
