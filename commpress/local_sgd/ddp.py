"""Keeps a DDP model's steps local during Local SGD: a comm hook that returns each bucket's
local gradient unchanged (registered once, where ``no_sync()`` must wrap every step), and DDP's
broadcast of rank 0's buffers before each forward off: a collective every step, the coupling
Local SGD exists to remove (docs/local_sgd.md). Buffers stay each rank's own, as parameters do."""

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
    """``model``'s gradients kept local and its buffers not broadcast, until :meth:`remove`."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        self.attribute = ddp_forward_buffer_sync(model)
        self.synced_buffers = bool(getattr(model, self.attribute, True))
        self.switch = register_removable_hook(model, None, local_gradients_hook)
        setattr(model, self.attribute, False)

    def remove(self) -> None:
        """Put DDP's gradient all-reduce and the model's own buffer setting back."""
        self.switch.remove()
        setattr(self.model, self.attribute, self.synced_buffers)


def skip_gradient_allreduce(model: DistributedDataParallel) -> LocalSteps:
    """Keep ``model``'s steps local (call before its first backward); DDP refuses a model that
    already has a comm hook."""
    return LocalSteps(model)
