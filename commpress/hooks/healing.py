"""The replay of a step by a replica that heals in it under a torchft Manager: once handed a
healthy peer's shared state (in ``should_commit()``), it replays the step's reductions on it, in
order, on the results its backend recorded
(:attr:`~commpress.comm.manager_backend.ManagerBackend.log`), so its shared state ends the step
equal to its peers'. A plan handed over (not made this step) is already in the peer's state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from commpress.comm.manager_backend import replay
from commpress.compressors import Bucket, Compressor, Context, ParamSlot
from commpress.layerwise.groups import LayerwiseGroups

__all__ = ["HealLog"]


class HealLog:
    """Per reduction of the step, what its replay needs: a bucket's layout and context, the
    step a plan was made at, or nothing (the plan in force handed over)."""

    def __init__(self) -> None:
        self._entries: list[tuple[Any, ...] | None] = []

    def clear(self) -> None:
        self._entries = []

    def bucket(self, index: int, buffer: torch.Tensor, slots: tuple[ParamSlot, ...], ctx: Context) -> None:
        self._entries.append((index, buffer.numel(), buffer.dtype, buffer.device, slots, ctx))

    def plan(self, step: int, device: torch.device) -> None:
        self._entries.append((step, device))

    def handed_over(self) -> None:
        self._entries.append(None)

    def replay(self, composite: Compressor, layerwise: LayerwiseGroups | None, start_iter: int, log: Sequence[list[Any]]) -> None:
        """Run every recorded reduction on its recorded results, on the state just loaded; buckets
        reduce zeros (a healing replica's input counts as nothing)."""
        for entry, results in zip(self._entries, log, strict=True):
            if entry is None:
                continue
            if len(entry) == 2:  # the step's plan, before its buckets
                assert layerwise is not None
                layerwise.hold()
                replay(layerwise.planning(*entry), results)
                continue
            index, numel, dtype, device, slots, ctx = entry
            if ctx.step >= start_iter:
                replay(composite.reduce(Bucket(index, torch.zeros(numel, dtype=dtype, device=device), slots), ctx), results)
