"""Replica groups of a sharded model: the 2-D device mesh a user hands
:func:`commpress.register` (``mesh=``), whose ``"shard"`` dimension FSDP2 shards the model
over inside a group and whose ``"replicate"`` dimension joins the groups, which commpress
alone communicates over (DiLoCo's outer syncs, or the compressed cross-group gradient
average).

Rank ``(g, s)`` holds shard ``s`` of group ``g``'s model; it exchanges its shard with the
ranks ``(g', s)`` holding the same shard in the other groups, so every exchange runs on a
shard's own rows and nothing is gathered across groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from commpress.errors import ConfigError

__all__ = ["REPLICATE", "SHARD", "ReplicaGroups", "replica_groups"]

REPLICATE, SHARD = "replicate", "shard"


@dataclass(frozen=True)
class ReplicaGroups:
    """What commpress takes from a 2-D mesh: ``replicate``, the process group of the ranks
    holding this rank's shard in every group (FSDP2 keeps the ``shard`` side), and its shape."""

    replicate: Any  # torch.distributed.ProcessGroup
    groups: int  # replica groups
    shards: int  # shards per group
    shard_index: int  # which shard this rank holds

    def settings(self) -> dict[str, Any]:
        """What a checkpoint must be loaded with: the mesh's shape and this rank's shard."""
        return {"groups": self.groups, "shards": self.shards, "shard": self.shard_index}


def replica_groups(mesh: Any, model: torch.nn.Module, entry: str = "commpress.register()") -> ReplicaGroups:
    """``mesh``'s two dimensions, once ``model``'s parameters are known to be sharded over
    its ``"shard"`` dimension alone (FSDP2's ``fully_shard(module, mesh=mesh["shard"])``);
    a clear :class:`ConfigError` otherwise."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or set(names or ()) != {REPLICATE, SHARD}:
        got = f"a {mesh.ndim}-D DeviceMesh named {names}" if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise ConfigError(
            f"{entry}: mesh = {got} is not accepted; expected a 2-D DeviceMesh with mesh_dim_names "
            f"('{REPLICATE}', '{SHARD}'), e.g. init_device_mesh(device, (groups, shards), "
            f"mesh_dim_names=('{REPLICATE}', '{SHARD}'))"
        )
    shard_mesh = mesh[SHARD]
    for name, p in model.named_parameters():
        where = p.device_mesh if isinstance(p, DTensor) else None
        if where is None or where.ndim != 1 or not torch.equal(where.mesh, shard_mesh.mesh) or p.placements != (Shard(0),):
            how = "not sharded" if where is None else f"placed {p.placements} on a mesh of ranks {where.mesh.tolist()}"
            raise ConfigError(
                f"{entry}: parameter {name!r} is {how}; with mesh= every parameter must be sharded over "
                f"mesh['{SHARD}'] alone (ranks {shard_mesh.mesh.tolist()}): fully_shard(module, "
                f"mesh=mesh['{SHARD}']) on every unit and the root; commpress joins the groups over mesh['{REPLICATE}']"
            )
    return ReplicaGroups(
        replicate=mesh[REPLICATE].get_group(),
        groups=mesh[REPLICATE].size(),
        shards=shard_mesh.size(),
        shard_index=shard_mesh.get_local_rank(),
    )
