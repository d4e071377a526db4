"""Keeps a DDP model's steps local during Local SGD: a comm hook that returns each bucket's
local gradient unchanged, and DDP's broadcast of rank 0's buffers before each forward off.

A hook rather than ``no_sync()``: it is registered once, so the user's training loop stays
as it is, and it also covers the steps ``no_sync`` would miss (``no_sync`` must wrap every
forward and backward). Parameters are averaged by Local SGD itself, not through DDP. The
buffer broadcast is a collective in every forward: every step waits for the slowest rank
and a round trip, the per-step coupling Local SGD exists to remove (docs/local_sgd.md
measures it). Buffers stay each rank's own between averagings, as parameters do (and as
FSDP2 keeps them); ``average_buffers`` averages the floating-point ones with the model.
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations.

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commpress.hooks.removable import register_removable_hook
from commpress.torch_compat import ddp_forward_buffer_sync

__all__ = ["LocalSteps", "local_gradients_hook", "skip_gradient_allreduce"]


def local_gradients_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that communicates nothing: every rank keeps its own gradient."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class LocalSteps:
    """``model``'s gradients kept local (:func:`local_gradients_hook`) and its buffers not
    broadcast before each forward, until :meth:`remove` puts DDP's all-reduce and the
    model's own buffer setting back."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        self.attribute = ddp_forward_buffer_sync(model)
        self.synced_buffers = bool(getattr(model, self.attribute, True))
        self.switch = register_removable_hook(model, None, local_gradients_hook)
        setattr(model, self.attribute, False)

    def remove(self) -> None:
        """DDP all-reduces gradients and syncs buffers as it was built to again."""
        self.switch.remove()
        setattr(self.model, self.attribute, self.synced_buffers)


def skip_gradient_allreduce(model: DistributedDataParallel) -> LocalSteps:
    """Keep ``model``'s steps local (register before its first backward); the
    :class:`LocalSteps` it returns turns DDP's all-reduce and buffer sync back on.

    DDP takes one comm hook per model, so a model that already has one is refused by DDP.
    """
    return LocalSteps(model)
