"""DDP comm hooks that can be taken off again: DDP cannot remove a comm hook, so commpress
registers its hooks through a :class:`CommHookSwitch`, under the hook's own ``__qualname__``, by
which DDP's logging data (``_get_ddp_logging_data()["comm_hook"]``) names it."""

# No `from __future__ import annotations`: DDP inspects the hook's annotations.

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

__all__ = ["CommHookSwitch", "register_removable_hook"]


class CommHookSwitch:
    """``hook(state, bucket)`` while on; DDP's plain all-reduce after :meth:`remove`."""

    def __init__(self, state: Any, hook: Callable[[Any, dist.GradBucket], torch.futures.Future], process_group: Any) -> None:
        self.state = state
        self.hook = hook
        self.process_group = process_group
        self.on = True

    def remove(self) -> None:
        """From the next bucket on, DDP all-reduces as it does without a comm hook."""
        self.on = False


def register_removable_hook(model: DistributedDataParallel, state: Any, hook: Callable[..., Any]) -> CommHookSwitch:
    """``model.register_comm_hook(state, hook)``, through a switch that :meth:`CommHookSwitch.remove` turns off."""
    switch = CommHookSwitch(state, hook, model.process_group)
    model.register_comm_hook(switch, _named_after(hook))
    return switch


def _named_after(hook: Callable[..., Any]) -> Callable[[CommHookSwitch, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """The DDP comm hook registered in place of ``hook``, under its names (for DDP's logging)."""

    def named(switch: CommHookSwitch, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if switch.on:
            return switch.hook(switch.state, bucket)
        return default_hooks.allreduce_hook(switch.process_group, bucket)

    named.__name__, named.__qualname__, named.__module__ = hook.__name__, hook.__qualname__, hook.__module__
    return named
