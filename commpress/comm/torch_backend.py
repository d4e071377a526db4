"""The torch.distributed backend: gloo on CPU, NCCL on GPU; and its links, for measuring them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commpress.comm.backend import Channel
from commpress.comm.callbacks import outlive_worker
from commpress.comm.links import Links, MeasurableBackend
from commpress.compressors.wire.collectives import AllGather, AllReduce, Collective, ReduceScatter, sum_rows
from commpress.torch_compat import all_gather_single

__all__ = ["TorchBackend", "TorchLinks", "group_timeout", "require_initialized"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


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


class TorchBackend(MeasurableBackend):
    """Runs reductions with async torch.distributed collectives over ``process_group``, one
    communicator per channel with the group's timeout; ``scopes`` partitions the group's ranks
    for ``"domain"``/``"cross"``. Every rank constructs it together, in the same order relative
    to other group creations."""

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
        self._outputs: dict[int, torch.Tensor] = {}  # by id of the collective in flight
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

    def __del__(self) -> None:
        # its last reference may go on a channel group's own thread (comm/callbacks.py)
        outlive_worker(getattr(self, "group", None), getattr(self, "_comms", None))

    def members(self, scope: str) -> list[int]:
        return self._members[scope]

    def links(self) -> TorchLinks:
        """A new group of this backend's ranks (with its timeout) for measuring the links."""
        return TorchLinks(dist.new_group(dist.get_process_group_ranks(self.group), timeout=group_timeout(self.group)))

    def scoped(self, rounds: Mapping[str, int], scopes: Mapping[str, Sequence[Sequence[int]]]) -> TorchBackend:
        return TorchBackend(self.group, rounds, scopes=scopes)

    def allgather_object(self, obj: object) -> list[object]:
        return allgather_object(obj, self.group)

    def _start(self, channel: Channel, request: Collective) -> torch.futures.Future:
        """The collective's own future; :meth:`_result` makes the result in the counted callback."""
        group = self._comms[channel]
        if isinstance(request, AllReduce):
            return dist.all_reduce(request.tensor, op=_OPS[request.op], group=group, async_op=True).get_future()
        flat = request.tensor.reshape(-1).contiguous()
        if isinstance(request, ReduceScatter):
            # all-to-all plus a sum in rank order: reproducible, and gloo's reduce-scatter gives no future
            out = self._outputs[id(request)] = torch.empty_like(flat)
            return dist.all_to_all_single(out, flat, group=group, async_op=True).get_future()
        assert isinstance(request, AllGather)
        out = self._outputs[id(request)] = flat.new_empty(group.size() * flat.numel())
        return all_gather_single(out, flat, group=group, async_op=True).get_future()

    def _result(self, channel: Channel, request: Collective, fut: torch.futures.Future) -> Any:
        """The tensor reduced in place, the reduce-scatter's rows summed, or the gathered rows."""
        out = self._outputs.pop(id(request), None)  # None for an all-reduce, or where it failed to start
        fut.value()  # raises the collective's error: never local or uninitialised data
        if isinstance(request, AllReduce):
            return request.tensor
        assert out is not None
        rows = out.view(self._comms[channel].size(), -1)
        return sum_rows(rows) if isinstance(request, ReduceScatter) else list(rows.unbind(0))


class TorchLinks(Links):
    """:class:`~commpress.comm.links.Links` over a torch.distributed group (default: the world)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        require_initialized("measuring the links")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.ranks = dist.get_process_group_ranks(self.group)
        nccl = dist.get_backend(self.group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        dist.send(tensor, self.ranks[peer], group=self.group)

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        dist.recv(tensor, self.ranks[peer], group=self.group)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.Work:
        return dist.isend(tensor, self.ranks[peer], group=self.group, tag=tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.Work:
        return dist.irecv(tensor, self.ranks[peer], group=self.group, tag=tag)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def allgather_object(self, obj: Any) -> list[Any]:
        return allgather_object(obj, self.group)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]


def allgather_object(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank of ``group``'s ``obj`` (picklable), blocking: for set-up checks and checkpoints."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
