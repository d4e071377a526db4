"""What a replica that heals in a step under a torchft Manager replays once it has a peer's
state: the step's reductions, in the order they ran, on the results its backend recorded
(:attr:`~commpress.comm.manager_backend.ManagerBackend.log`).

A healing replica contributes nothing to the step it heals in; when the manager hands it a
healthy peer's shared state (in ``should_commit()``), the hook replays the step's
collectives on that state, so its shared state ends the step equal to its peers'. A step's
``[layerwise]`` plan is replayed before its buckets; the plan in force, handed over at a
step that does not plan, is already in the peer's state: nothing to replay.
"""

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
        """Run every recorded reduction on its recorded results, on the state just loaded:
        the plan with ``layerwise``, each bucket (from ``start_iter`` on) with ``composite``
        on zeros (a healing replica's input counts as nothing)."""
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
