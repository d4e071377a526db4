"""Keeps DDP from all-reducing gradients during Local SGD: a comm hook that returns each
bucket's local gradient unchanged.

A hook rather than ``no_sync()``: it is registered once, so the user's training loop stays
as it is, and it also covers the steps ``no_sync`` would miss (``no_sync`` must wrap every
forward and backward). Parameters are averaged by Local SGD itself, not through DDP.
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations.

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commpress.hooks.removable import CommHookSwitch, register_removable_hook

__all__ = ["local_gradients_hook", "skip_gradient_allreduce"]


def local_gradients_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that communicates nothing: every rank keeps its own gradient."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def skip_gradient_allreduce(model: DistributedDataParallel) -> CommHookSwitch:
    """Register :func:`local_gradients_hook` on ``model`` (before its first backward);
    the switch it returns turns DDP's all-reduce back on.

    DDP takes one comm hook per model, so a model that already has one is refused by DDP.
    """
    return register_removable_hook(model, None, local_gradients_hook)
