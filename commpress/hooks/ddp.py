"""The DDP comm hook, following ``torch.distributed.algorithms.ddp_comm_hooks`` conventions."""

# No `from __future__ import annotations` here: DDP inspects the hook's annotations
# and needs the real GradBucket / Future types, not strings.

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commpress.config import Config
from commpress.hooks.state import CommState

__all__ = ["ddp_hook", "register"]


def ddp_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` with the compressor configured in ``state``.

    Register it like PyTorch's own hooks: ``ddp_model.register_comm_hook(state, ddp_hook)``.
    """
    return state.reduce(bucket.index(), bucket.buffer(), bucket.parameters(), advance=bucket.is_last())


def register(
    model: DistributedDataParallel,
    config: Config | Mapping[str, Any] | str | None = None,
    process_group: Any = None,
) -> CommState:
    """Build a :class:`CommState` for ``model`` from ``config`` and register :func:`ddp_hook`.

    Call it on every rank, after wrapping the model in DDP and before the first backward.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"register() expects a DistributedDataParallel model, got {type(model).__name__}")
    cfg = Config.load(config)
    group = process_group if process_group is not None or cfg.backend != "torch" else model.process_group
    state = CommState(cfg, model=model.module, process_group=group)
    model.register_comm_hook(state, ddp_hook)
    return state
