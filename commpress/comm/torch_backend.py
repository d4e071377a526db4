"""The torch.distributed backend: gloo on CPU, NCCL on GPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commpress.comm.backend import Backend
from commpress.compressors.base import AllGather, AllReduce, Collective

__all__ = ["TorchBackend", "all_gather_single"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch >= 2.13 names it all_gather_single and deprecates all_gather_into_tensor.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchBackend(Backend):
    """Runs reductions with async torch.distributed collectives.

    Opens one communicator per round over the ranks of ``process_group`` (all of them
    must construct the backend together, in the same order relative to other group
    creations), or uses ``channels``, one communicator per round over the same ranks,
    created by the caller (who may need every rank of the world to create them together).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        rounds: int = 1,
        channels: list[dist.ProcessGroup] | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "the torch backend needs torch.distributed initialized: call "
                'torch.distributed.init_process_group(...) first (or use backend = "mpi" under mpirun)'
            )
        group = process_group if process_group is not None else dist.group.WORLD
        rounds = len(channels) if channels is not None else rounds
        super().__init__(dist.get_rank(group), dist.get_world_size(group), rounds)
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        self._groups = channels or [dist.new_group(ranks, use_local_synchronization=True) for _ in range(rounds)]

    def allgather_object(self, obj: object) -> list[object]:
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _start(self, channel: int, request: Collective) -> torch.futures.Future:
        group = self._groups[channel]
        if isinstance(request, AllReduce):
            tensor = request.tensor
            work = dist.all_reduce(tensor, op=_OPS[request.op], group=group, async_op=True)
            return work.get_future().then(lambda _: tensor)
        assert isinstance(request, AllGather)
        tensor = request.tensor.reshape(-1)
        if request.uniform:
            sizes = [tensor.numel()] * self.world_size
        else:
            mine = torch.tensor([tensor.numel()], dtype=torch.int64, device=tensor.device)
            all_sizes = mine.new_empty(self.world_size)
            all_gather_single(all_sizes, mine, group=group)
            self.traffic.add(nbytes=mine.numel() * mine.element_size(), collectives=1)
            sizes = all_sizes.tolist()
        longest = max(sizes)
        if longest == 0:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result([tensor.new_empty(0) for _ in sizes])
            return fut
        if tensor.numel() < longest:
            tensor = torch.cat([tensor, tensor.new_zeros(longest - tensor.numel())])
        out = tensor.new_empty(self.world_size * longest)
        work = all_gather_single(out, tensor.contiguous(), group=group, async_op=True)
        rows = out.view(self.world_size, longest)
        return work.get_future().then(lambda _: [rows[i, :n] for i, n in enumerate(sizes)])
