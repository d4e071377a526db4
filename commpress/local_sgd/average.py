"""A pseudo-gradient being averaged over ranks, and the check every average passes before
it reaches the anchor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from commpress.compressors import host
from commpress.local_sgd.fragments import Fragment

__all__ = ["Average", "InFlight", "check_finite"]

#: a rank's vote on an average (the shards' minimum wins): not finite, failed, fine
_NON_FINITE, _FAILED, _FINE = 0, 1, 2


@dataclass
class Average:
    """A pseudo-gradient being averaged over ranks, in place in ``buffer``, started in
    round ``round``."""

    future: torch.futures.Future
    buffer: torch.Tensor
    round: int


@dataclass
class InFlight:
    """A fragment's average and the step count at which it lands; ``replace``: the local
    values then take the anchor's whatever the merge (the final syncs of finish); ``start``:
    the local values after the eager move (``merge = "eager"`` with a delay)."""

    average: Average
    fragment: Fragment
    due: int
    replace: bool = False
    start: torch.Tensor | None = None


def check_finite(average: torch.Tensor, name: str, round_index: int, shard_group: Any = None, failed: bool = False) -> None:
    """Refuse a non-finite average before it reaches the anchor (or CO2's momentum): every
    rank holds the same average, so every rank raises, and the state stays as it was. A
    sharded model's ranks (``shard_group``, the ranks holding the other shards) agree first,
    so a shard's inf stops its whole group, not its own rank alone. A rank whose average
    ``failed`` (its collective raised: a lost replica under a torchft Manager) votes too,
    so its shards' ranks never wait for it: they raise a RuntimeError, and the caller
    re-raises the failure; an inf anywhere outranks a failure."""
    status = _FAILED if failed else (_FINE if host.flags(host.finite(average))[0] else _NON_FINITE)
    if shard_group is not None:
        flag = torch.tensor([status], dtype=torch.int32, device=average.device)  # NCCL takes CUDA tensors only
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=shard_group)
        status = int(flag.item())
    if status == _NON_FINITE:
        raise FloatingPointError(
            f"{name}: the average of round {round_index} is not finite (a rank's model holds inf or NaN); "
            "the anchor and the outer state were left unchanged: restore a checkpoint or lower the learning rate"
        )
    if status == _FAILED and not failed:
        raise RuntimeError(f"{name}: the average of round {round_index} failed on a rank holding another shard of the model")
