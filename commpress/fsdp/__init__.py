"""Compressed communication for sharded training (FSDP2 ``fully_shard`` and FSDP1).

One call, on every rank, after sharding and before the first forward::

    import commpress.fsdp
    state = commpress.fsdp.apply(model, {"weight_bits": 8, "grad_bits": 8})

FSDP2 gets quantized weight all-gathers (QSDP: master shards stay full precision) and gradient
reduce-scatters; an FSDP1 root gets :func:`quantized_hook`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from commpress.comm.agreement import agree_on_settings
from commpress.config.tables import FSDPConfig
from commpress.fsdp.config import load_fsdp_config
from commpress.fsdp.fsdp1 import LowPrecisionState, QuantizedState, low_precision_hook, quantized_hook, register_fsdp1
from commpress.fsdp.fsdp2 import FSDP2State, QuantizedAllGather, QuantizedReduceScatter, apply_fsdp2

__all__ = [
    "FSDP2State",
    "FSDPConfig",
    "LowPrecisionState",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "QuantizedState",
    "apply",
    "load_fsdp_config",
    "low_precision_hook",
    "quantized_hook",
]


def apply(
    model: torch.nn.Module,
    config: Any = None,
    *,
    recurse: bool = True,
    root: torch.nn.Module | None = None,
) -> FSDP2State | QuantizedState:
    """Quantize ``model``'s FSDP communication as ``config`` (anything :func:`load_fsdp_config`
    reads) says. FSDP2: every ``fully_shard``-ed module (``recurse=False``: ``model`` alone),
    ``exclude`` names relative to ``root``; FSDP1: ``model`` is the root."""
    cfg = load_fsdp_config(config)
    if isinstance(model, FullyShardedDataParallel):
        state = register_fsdp1(model, cfg)
    else:
        state = apply_fsdp2(model, cfg, recurse=recurse, root=root)
        if not state.units:
            raise TypeError(
                f"commpress.fsdp.apply found no sharded module in {type(model).__name__}: call it after "
                "fully_shard(...) (FSDP2) or on the FullyShardedDataParallel root (FSDP1)"
            )
    # names only: an FSDP1 flat shard's size differs by rank
    settings = {"fsdp": dataclasses.asdict(cfg), "model": [n for n, _ in model.named_parameters()]}
    agree_on_settings(settings, "commpress.fsdp.apply", "torch", None, detail=settings["fsdp"])
    return state
