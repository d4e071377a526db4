"""The tensors Local SGD averages (parameters, optionally floating-point buffers), seen as
one flat vector, so one collective carries the whole model. A parameter sharded with FSDP2
(a DTensor) contributes its local shard: the vector is this rank's part of the model."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from commpress.compressors import Bucket, lay_out

__all__ = ["FlatModel", "local", "unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the module itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@torch.no_grad()
def local(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values held by this rank: a DTensor's local shard (read each time, as
    FSDP2 may rebind it at its lazy initialization), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class FlatModel:
    """Copies the model's parameters (and float buffers, if asked) to and from a flat vector."""

    def __init__(self, model: nn.Module, buffers: bool = False) -> None:
        module = unwrap(model)
        named = list(module.named_parameters())
        if buffers:
            named += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        if not named:
            raise ValueError("the model has no parameters to average")
        dtypes = {t.dtype for _, t in named}
        if len(dtypes) > 1:
            found = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            raise TypeError(f"Local SGD averages one flat vector: all parameters must share a dtype, found {found}")
        self.tensors = [t for _, t in named]
        self.slots, self.numel = lay_out((name, local(t).shape) for name, t in named)
        #: every tensor's whole size (a shard's parameter's, not its shard's)
        self.whole_numel = tuple(t.numel() for _, t in named)
        self.dtype = self.tensors[0].dtype
        self.device = self.tensors[0].device
        meshes = {tuple(t.device_mesh.mesh.flatten().tolist()): t.device_mesh for t in self.tensors if isinstance(t, DTensor)}
        if len(meshes) > 1:
            raise ValueError("Local SGD averages one flat vector: the sharded parameters must share one mesh")
        #: the group of ranks holding the other shards of this model (None: not sharded)
        self.shard_group = next(iter(meshes.values())).get_group() if meshes else None

    def bucket(self, buffer: torch.Tensor, index: int = 0) -> Bucket:
        """``buffer`` (a flat vector) as a bucket whose slots name the model's tensors."""
        return Bucket(index, buffer, self.slots)

    def _span(self, tensors: range | None) -> tuple[range, int, int]:
        which = range(len(self.tensors)) if tensors is None else tensors
        start, last = self.slots[which[0]].offset, self.slots[which[-1]]
        return which, start, last.offset + last.numel - start

    @torch.no_grad()
    def read(self, out: torch.Tensor | None = None, tensors: range | None = None) -> torch.Tensor:
        """The model's values, flat (into ``out``); ``tensors``: only those, from the first one's offset."""
        which, start, numel = self._span(tensors)
        if out is None:
            out = torch.empty(numel, dtype=self.dtype, device=self.device)
        for i in which:
            slot = self.slots[i]
            out[slot.offset - start : slot.offset - start + slot.numel].copy_(local(self.tensors[i]).reshape(-1))
        return out

    @torch.no_grad()
    def write(self, flat: torch.Tensor, tensors: range | None = None) -> None:
        """Set the model's tensors (``tensors``: only those) from the flat vector ``flat``."""
        which, start, _ = self._span(tensors)
        for i in which:
            slot, t = self.slots[i], local(self.tensors[i])
            t.copy_(flat[slot.offset - start : slot.offset - start + slot.numel].view(t.shape))
