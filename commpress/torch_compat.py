"""The torch API that differs between the releases commpress supports (torch >= 2.9), in one
place. A newer name is looked up when called, first (later releases deprecate the older), its 2.9
equivalent used where this torch lacks it; what 2.9 lacks is refused on import. docs/versions.md
lists each; tests/test_old_torch.py runs commpress with the newer names hidden.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TORCH_FLOOR",
    "FSDPAllGather",
    "FSDPDefaultAlloc",
    "FSDPReduceScatter",
    "all_gather_single",
    "ddp_forward_buffer_sync",
    "fsdp_param_groups",
    "needs",
    "reduce_scatter_single",
]

#: The oldest torch release commpress runs on (FSDP2's custom collectives arrived in it).
TORCH_FLOOR = "2.9"


def needs(release: str, feature: str) -> str:
    """The message refusing ``feature`` on this torch, older than ``release``."""
    return f"commpress needs torch >= {release} for {feature} (this is torch {torch.__version__})"


try:  # FSDP2's custom all-gather / reduce-scatter interface: torch 2.9
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FSDPAllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FSDPReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin as FSDPDefaultAlloc
except ImportError as exc:
    raise ImportError(needs(TORCH_FLOOR, "FSDP2's custom all-gather and reduce-scatter (commpress.fsdp)")) from exc


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    """Torch 2.13's ``dist.all_gather_single``, else ``dist.all_gather_into_tensor`` (the same call)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Torch 2.13's ``dist.reduce_scatter_single``, else ``dist.reduce_scatter_tensor`` (the same call)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)


def ddp_forward_buffer_sync(model: Any) -> str:
    """The DDP attribute that turns on the broadcast of rank 0's buffers before each forward:
    torch 2.13's ``forward_sync_buffers``, else 2.9's ``broadcast_buffers``."""
    return "forward_sync_buffers" if hasattr(model, "forward_sync_buffers") else "broadcast_buffers"


def fsdp_param_groups(state: Any) -> list[Any]:
    """One FSDP2 module state's parameter groups: a list after 2.9, one optional group in 2.9."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [group] if group is not None else []
