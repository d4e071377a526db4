"""Compressed communication for sharded training (FSDP2 ``fully_shard`` and FSDP1).

One call, on every rank, after sharding and before the first forward::

    import commpress.fsdp
    state = commpress.fsdp.apply(model, {"weight_bits": 8, "grad_bits": 8})

For FSDP2 it quantizes every ``fully_shard``-ed module's parameter all-gather (QSDP: b-bit
weights, full-precision master shards) and gradient reduce-scatter; for an FSDP1 root it
registers :func:`quantized_hook`. ``config`` is an :class:`FSDPConfig`, the ``[fsdp]``
table's keys as a dict, a full commpress config (dict or TOML path) with an ``[fsdp]``
table, or None (defaults: 8-bit weights and gradients).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from commpress.comm.agreement import agree_on_settings
from commpress.config.tables import FSDPConfig
from commpress.fsdp.config import load_fsdp_config
from commpress.fsdp.fsdp1 import (
    LowPrecisionState,
    QuantizedState,
    low_precision_hook,
    quantized_hook,
    register_fsdp1,
)
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
    """Quantize ``model``'s FSDP communication as ``config`` says; returns the state
    (``traffic()`` / ``traffic``, ``state_dict()``).

    FSDP2: every ``fully_shard``-ed module in ``model`` (only ``model`` itself with
    ``recurse=False``); ``exclude`` globs match names relative to ``root`` (default
    ``model``). FSDP1: ``model`` must be the root ``FullyShardedDataParallel``.
    """
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
    # every rank must quantize the same tensors the same way: agree before the first
    # collective (the next forward); names only, an FSDP1 flat shard's size differs by rank
    settings = {"fsdp": dataclasses.asdict(cfg), "model": [n for n, _ in model.named_parameters()]}
    agree_on_settings(settings, "commpress.fsdp.apply", "torch", None, detail=settings["fsdp"])
    return state
