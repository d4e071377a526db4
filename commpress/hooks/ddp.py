"""The DDP comm hook, following ``torch.distributed.algorithms.ddp_comm_hooks`` conventions."""

# No `from __future__ import annotations`: DDP inspects the hook's annotations (real types, not strings).

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commpress.config import Config
from commpress.config.matrix import check_part
from commpress.hooks.optimizer import hand_over_momentum
from commpress.hooks.removable import register_removable_hook
from commpress.hooks.state import ENTRY, CommState

__all__ = ["attach_ddp_hook", "ddp_hook", "register_ddp_hook"]


def ddp_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` with the compressor configured in ``state``; register it like PyTorch's
    own hooks: ``ddp_model.register_comm_hook(state, ddp_hook)``."""
    return state.reduce(bucket.index(), bucket.buffer(), bucket.parameters(), advance=bucket.is_last())


def register_ddp_hook(
    model: DistributedDataParallel,
    config: Config | Mapping[str, Any] | str | None = None,
    process_group: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    manager: Any = None,
) -> CommState:
    """Build a :class:`CommState` for ``model`` from ``config`` and register :func:`ddp_hook`: the
    DDP part of :func:`commpress.register`, which explains the arguments and when to call it."""
    cfg = Config.load(config)
    check_part(cfg, "ddp_hook", ENTRY, managed=manager is not None)
    return attach_ddp_hook(model, cfg, process_group, optimizer, manager)[0]


def attach_ddp_hook(
    model: DistributedDataParallel,
    cfg: Config,
    process_group: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    manager: Any = None,
) -> tuple[CommState, Callable[[], None]]:
    """:func:`register_ddp_hook` of a config the matrix has accepted, and the call that takes it
    off again (plain DDP all-reduce, the optimizer's momentum given back)."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"register_ddp_hook() expects a DistributedDataParallel model, got {type(model).__name__}")
    if manager is not None and type(model).__module__.startswith("torchft"):
        raise TypeError(
            "torchft's DistributedDataParallel registers its own all-reduce hook, and DDP takes one hook only: wrap the "
            "module with commpress.hooks.managed_ddp(module) instead (the same DDP, without that hook)"
        )
    group = cfg.group_for(model, process_group)
    state = CommState.of_part(cfg, model=model.module, process_group=group, manager=manager)
    groups = state.groups
    compressor_of = lambda name: groups.compressors[groups.key_for(name)]  # noqa: E731
    give_back = hand_over_momentum(optimizer, model.module.named_parameters(), compressor_of, cfg.start_iter)
    state.load_kernels()  # compiled or loaded now, not on the training clock
    switch = register_removable_hook(model, state, ddp_hook)

    def remove() -> None:
        switch.remove()
        give_back()

    return state, remove
