"""The tensors Local SGD averages (parameters, optionally floating-point buffers), seen as
one flat vector, so one collective carries the whole model."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from commpress.compressors import Bucket, ParamSlot

__all__ = ["FlatModel", "unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the module itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


class FlatModel:
    """Copies the model's parameters (and float buffers, if asked) to and from a flat vector."""

    def __init__(self, model: nn.Module, buffers: bool = False) -> None:
        module = unwrap(model)
        named = [(n, p) for n, p in module.named_parameters()]
        if buffers:
            named += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        if not named:
            raise ValueError("the model has no parameters to average")
        dtypes = {t.dtype for _, t in named}
        if len(dtypes) > 1:
            found = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            raise TypeError(f"Local SGD averages one flat vector: all parameters must share a dtype, found {found}")
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]
        slots, offset = [], 0
        for name, t in named:
            slots.append(ParamSlot(name, t.shape, offset))
            offset += t.numel()
        self.slots = tuple(slots)
        self.numel = offset
        self.dtype = self.tensors[0].dtype
        self.device = self.tensors[0].device

    def empty(self) -> torch.Tensor:
        """A new uninitialized flat vector."""
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def bucket(self, buffer: torch.Tensor, index: int = 0) -> Bucket:
        """``buffer`` (a flat vector) as a bucket whose slots name the model's tensors."""
        return Bucket(index, buffer, self.slots)

    @torch.no_grad()
    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The model's current values, flat (into ``out`` if given)."""
        out = self.empty() if out is None else out
        for slot, t in zip(self.slots, self.tensors):
            out[slot.offset : slot.offset + slot.numel].copy_(t.reshape(-1))
        return out

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        """Set the model's tensors from the flat vector ``flat``."""
        for slot, t in zip(self.slots, self.tensors):
            t.copy_(flat[slot.offset : slot.offset + slot.numel].view(t.shape))
