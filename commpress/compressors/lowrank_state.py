"""Per-bucket state of the low-rank compressors, and how it survives DDP's bucket rebuild.

DDP runs its first step with an initial bucket layout and then rebuilds its buckets (after
a resume as well). State is keyed on the bucket index and valid for one layout only; when
a bucket's layout changes, its new state takes each parameter's error and factors from the
state that held that parameter last, so nothing is lost at the rebuild and a resumed run
continues exactly like an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from commpress.compressors.base import Bucket, ParamSlot
from commpress.compressors.lowrank_plan import LowRankPlan

__all__ = ["BucketState", "StateStore"]

_KEYS = frozenset({"slots", "numel", "steps", "error", "q", "p"})


@dataclass
class BucketState:
    """Everything kept for one bucket between steps."""

    plan: LowRankPlan
    numel: int  # elements of the bucket buffer
    steps: int = 0  # compressed steps that completed (ACP-SGD alternates on it)
    error: torch.Tensor | None = None  # flat fp32, zero at dense positions
    q: torch.Tensor | None = None  # flat fp32: transposed Q of every batch (the warm start)
    p: torch.Tensor | None = None  # flat fp32: P of every batch (ACP-SGD)
    spare: torch.Tensor | None = field(default=None, repr=False)  # the error double buffer
    unclaimed: set[str] = field(default_factory=set, repr=False)  # once retired: names not yet taken over

    def to_dict(self) -> dict[str, Any]:
        """Plain data plus tensor copies, for checkpoints."""

        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()

        return {
            "slots": [(s.name, tuple(s.shape), s.offset) for s in self.plan.slots],
            "numel": self.numel,
            "steps": self.steps,
            "error": copy(self.error),
            "q": copy(self.q),
            "p": copy(self.p),
        }

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any], make_plan: Callable[[tuple[ParamSlot, ...]], LowRankPlan]) -> BucketState:
        if set(saved) != _KEYS:
            raise ValueError(f"low-rank bucket state needs keys {sorted(_KEYS)}, got {sorted(saved)}")
        slots = tuple(ParamSlot(str(n), torch.Size(shape), int(off)) for n, shape, off in saved["slots"])

        def load(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().clone().float()

        tensors = {key: load(saved[key]) for key in ("error", "q", "p")}
        return cls(make_plan(slots), int(saved["numel"]), int(saved["steps"]), **tensors)


class StateStore:
    """Bucket states by index, with the take-over of parameters across layout changes."""

    def __init__(self) -> None:
        self.buckets: dict[int, BucketState] = {}
        self.retired: list[BucketState] = []

    def get(
        self,
        bucket: Bucket,
        make_plan: Callable[[tuple[ParamSlot, ...]], LowRankPlan],
        random_qt: Callable[[BucketState], torch.Tensor],
    ) -> BucketState:
        """The state of ``bucket``; a new one (taking over its parameters) if the layout changed."""
        slots = tuple(bucket.slots)
        st = self.buckets.get(bucket.index)
        if st is not None and st.plan.slots == slots:
            return st
        if st is not None:
            self._retire(st)
            del self.buckets[bucket.index]
        new = BucketState(make_plan(slots), bucket.buffer.numel())
        self._take_over(new, random_qt)
        self.buckets[bucket.index] = new
        return new

    def _retire(self, st: BucketState) -> None:
        st.spare = None
        st.unclaimed = {s.name for s in st.plan.slots}
        self.retired.append(st)

    def _take_over(self, new: BucketState, random_qt: Callable[[BucketState], torch.Tensor]) -> None:
        holder: dict[str, tuple[BucketState, ParamSlot]] = {}
        for src in self.retired:
            holder.update((s.name, (src, s)) for s in src.plan.slots if s.name in src.unclaimed)
        for src in self.buckets.values():
            holder.update((s.name, (src, s)) for s in src.plan.slots)
        found = {s.name: holder[s.name] for s in new.plan.slots if s.name in holder and holder[s.name][1].shape == s.shape}
        if not found:
            return
        sources = {id(src): src for src, _ in found.values()}
        new.steps = max(src.steps for src in sources.values())
        if any(src.error is not None for src in sources.values()):
            new.error = torch.zeros(new.numel)
            for s in new.plan.slots:
                src, old = found.get(s.name, (None, None))
                if src is not None and src.error is not None:
                    new.error[s.offset : s.offset + s.numel] = src.error[old.offset : old.offset + old.numel]
        for attr in ("q", "p"):
            if any(getattr(src, attr) is not None for src in sources.values()):
                flat = random_qt(new) if attr == "q" else torch.zeros(new.plan.p_numel)
                _copy_factors(attr, new, flat, found)
                setattr(new, attr, flat)
        claimed = set(found)
        # a current state that gave up parameters is superseded: retire what it still holds
        for index, src in list(self.buckets.items()):
            if id(src) in sources:
                del self.buckets[index]
                self._retire(src)
        for src in self.retired:
            src.unclaimed -= claimed
        self.retired = [src for src in self.retired if src.unclaimed]


def _copy_factors(attr: str, new: BucketState, flat: torch.Tensor, found: dict[str, tuple[BucketState, ParamSlot]]) -> None:
    """Copy each matrix's factor block (``q``: r x m, ``p``: n x r) from its old state."""
    views = new.plan.qt_views if attr == "q" else new.plan.p_views
    names = {s.offset: s.name for s in new.plan.slots}
    for batch, block in zip(new.plan.batches, views(flat)):
        for k in range(batch.count):
            src, old = found.get(names[batch.first + k * batch.stride], (None, None))
            if src is None or getattr(src, attr) is None:
                continue
            where = src.plan.locate(old.offset)
            if where is not None:
                b, j = where
                old_view = (src.plan.qt_views if attr == "q" else src.plan.p_views)(getattr(src, attr))[b]
                if old_view.shape[1:] == block.shape[1:]:
                    block[k].copy_(old_view[j])
