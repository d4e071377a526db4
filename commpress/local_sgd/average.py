"""A pseudo-gradient being averaged over ranks, and the finiteness check every average passes."""

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
    """A pseudo-gradient averaging in place in ``buffer``, started in round ``round``."""

    future: torch.futures.Future
    buffer: torch.Tensor
    round: int

    @classmethod
    def landed(cls, buffer: torch.Tensor, round: int) -> Average:
        """An average already in ``buffer`` (restored, or not used)."""
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return cls(done, buffer, round)


@dataclass
class InFlight:
    """A fragment's average landing at step ``due``; ``replace``: the local values then take the
    anchor's whatever the merge (finish's syncs); ``start``: the local values after an eager move."""

    average: Average
    fragment: Fragment
    due: int
    replace: bool = False
    start: torch.Tensor | None = None


def check_finite(average: torch.Tensor, name: str, round_index: int, shard_group: Any = None, failed: bool = False) -> None:
    """Raise on a non-finite average before it reaches the anchor: every rank holds the same
    average, so every rank raises and the state stays unchanged. A sharded model's ranks
    (``shard_group``) vote first, so one shard's inf stops its whole group; a rank whose
    collective ``failed`` votes too, so the other shards' ranks raise instead of waiting."""
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
