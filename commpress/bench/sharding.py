"""A race's model sharded with FSDP2 inside replica groups (``race --shards S``): the 2-D
mesh of ``world / S`` groups of ``S`` ranks (consecutive ranks form a group, as
``linkemu --nodes`` groups them), and the model's layers sharded over it."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from commpress.errors import ConfigError

__all__ = ["replica_mesh", "shard_model"]

#: the modules that become their own FSDP unit, outermost first; the rest go with the root
#: (embeddings too: the transformer reads its position table's weight, not its forward)
_UNITS = (nn.TransformerEncoderLayer, nn.Linear)


def replica_mesh(world: int, shards: int) -> Any:
    """The ``("replicate", "shard")`` mesh of ``world`` ranks in groups of ``shards``."""
    from torch.distributed.device_mesh import init_device_mesh

    if shards < 1 or world % shards:
        raise ConfigError(f"--shards = {shards} is not accepted for {world} ranks; expected a divisor of {world}")
    return init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, mesh: Any, hsdp: bool) -> nn.Module:
    """``model`` sharded in place over ``mesh["shard"]`` (``hsdp``: over the whole mesh,
    FSDP2's own HSDP), each transformer layer and linear its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    # the race's loss reshapes the logits (out of place), which FSDP2 warns about on every rank
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    where = mesh if hsdp else mesh["shard"]
    taken: list[str] = []
    for name, module in model.named_modules():
        if name and isinstance(module, _UNITS) and not any(name.startswith(f"{t}.") for t in taken):
            taken.append(name)
            fully_shard(module, mesh=where)
    fully_shard(model, mesh=where)
    return model
