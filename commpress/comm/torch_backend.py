"""The torch.distributed backend: gloo on CPU, NCCL on GPU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from commpress.comm.backend import Backend, Channel
from commpress.compressors.collectives import AllGather, AllReduce, Collective, ReduceScatter

__all__ = ["TorchBackend", "all_gather_single", "group_timeout", "require_initialized", "sum_rows"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch >= 2.13 names it all_gather_single and deprecates all_gather_into_tensor.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def require_initialized(what: str) -> None:
    """Raise a clear error when torch.distributed is not initialized yet."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed initialized: call torch.distributed.init_process_group(...) "
            'first (or use backend = "mpi" under mpirun)'
        )


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The collective timeout of ``group`` (None when torch does not expose it)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


class TorchBackend(Backend):
    """Runs reductions with async torch.distributed collectives over ``process_group``.

    Opens one communicator per channel: ``rounds`` per scope (an int: the ``"world"``
    scope only). ``scopes`` maps ``"domain"``/``"cross"`` to a partition of the group's
    ranks (group-local rank numbers); this rank talks to the members of its part. Every
    rank of the group must construct the backend together, in the same order relative to
    other group creations. Channel communicators inherit the group's timeout, so a dead
    or stalled peer fails the collective within that time.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        rounds: int | Mapping[str, int] = 1,
        scopes: Mapping[str, Sequence[Sequence[int]]] | None = None,
    ) -> None:
        require_initialized("the torch backend")
        group = process_group if process_group is not None else dist.group.WORLD
        super().__init__(dist.get_rank(group), dist.get_world_size(group), rounds)
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        timeout = group_timeout(group)
        partitions = {"world": [list(range(self.world_size))], **{k: [list(p) for p in v] for k, v in (scopes or {}).items()}}
        self._members: dict[str, list[int]] = {}
        self._comms: dict[Channel, dist.ProcessGroup] = {}
        for channel in self._queues:
            scope = channel[0]
            if scope not in partitions:
                raise ValueError(f"rounds name scope {scope!r}, but no partition of the ranks was given for it")
            parts = partitions[scope]
            mine = next(p for p in parts if self.rank in p)
            self._members[scope] = [ranks[r] for r in mine]
            if scope == "world":  # only this group's ranks take part: it may be a subgroup
                self._comms[channel] = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
                continue
            # every rank creates every part, in order: group names stay equal across ranks
            for part in parts:
                comm = dist.new_group([ranks[r] for r in part], timeout=timeout)
                if part is mine:
                    self._comms[channel] = comm

    def members(self, scope: str) -> list[int]:
        return self._members[scope]

    def allgather_object(self, obj: object) -> list[object]:
        return allgather_object(obj, self.group)

    def _start(self, channel: Channel, request: Collective) -> torch.futures.Future:
        group = self._comms[channel]
        tensor = request.tensor
        if isinstance(request, AllReduce):
            work = dist.all_reduce(tensor, op=_OPS[request.op], group=group, async_op=True)
            return work.get_future().then(_checked(lambda: tensor))
        size = group.size()
        if isinstance(request, ReduceScatter):
            # all-to-all plus a sum in rank order: reproducible, and gloo's reduce-scatter
            # gives no future
            flat = tensor.reshape(-1).contiguous()
            received = torch.empty_like(flat)
            work = dist.all_to_all_single(received, flat, group=group, async_op=True)
            return work.get_future().then(_checked(lambda: sum_rows(received.view(size, -1))))
        assert isinstance(request, AllGather)
        flat = tensor.reshape(-1).contiguous()
        out = flat.new_empty(size * flat.numel())
        work = all_gather_single(out, flat, group=group, async_op=True)
        return work.get_future().then(_checked(lambda: list(out.view(size, -1).unbind(0))))


def sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """The sum of ``rows`` taken in row (rank) order, so every backend adds alike."""
    first, *rest = rows.unbind(0)
    total = first.clone()
    for row in rest:
        total += row
    return total


def _checked(result):
    """A ``then`` callback that re-raises the collective's error (never hands back local
    or uninitialised data) and otherwise returns ``result()``."""

    def done(fut: torch.futures.Future):
        fut.value()
        return result()

    return done


def allgather_object(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank of ``group``'s ``obj`` (picklable), blocking: for set-up checks and checkpoints."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
