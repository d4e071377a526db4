"""Replica groups of a sharded model: the 2-D mesh handed to :func:`commpress.register`
(``mesh=``). FSDP2 shards over ``"shard"``; commpress alone communicates over ``"replicate"``,
rank ``(g, s)`` exchanging with the ranks ``(g', s)`` holding the same shard, so nothing is
gathered across groups.
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
    """What commpress takes from the mesh: its shape and ``replicate``, the ranks holding this shard."""

    replicate: Any  # torch.distributed.ProcessGroup
    groups: int  # replica groups
    shards: int  # shards per group
    shard_index: int  # which shard this rank holds

    def settings(self) -> dict[str, Any]:
        """What a checkpoint must be loaded with: the mesh's shape and this rank's shard."""
        return {"groups": self.groups, "shards": self.shards, "shard": self.shard_index}


def replica_groups(mesh: Any, model: torch.nn.Module, entry: str = "commpress.register()") -> ReplicaGroups:
    """``mesh``'s replica groups; a :class:`ConfigError` unless ``model`` is sharded over ``mesh["shard"]`` alone."""
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
