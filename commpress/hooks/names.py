"""The name each parameter of a DDP bucket bears: what overrides and state keys follow."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commpress.compressors import ParamSlot, lay_out

__all__ = ["BucketNames"]


class BucketNames:
    """The model's names (``named``: id -> name), else names by order of first appearance (the same
    on every rank), or in an unpickled state the pickled order's (``bind``: (name, shape))."""

    def __init__(self, named: dict[int, str] | None = None, bind: list[tuple[str, tuple[int, ...]]] | None = None) -> None:
        self.named: dict[int, str] = dict(named or {})
        #: (name, shape) of every parameter in the order buckets first held them
        self.order: dict[str, tuple[int, ...]] = {}
        self.bind = bind

    def slots(self, buffer: torch.Tensor, params: Sequence[torch.Tensor] | None) -> tuple[ParamSlot, ...]:
        """Where each of ``params`` lies in the bucket's flat ``buffer``, under its name."""
        if params is None:
            return (ParamSlot("flat", buffer.shape, 0),)
        slots, numel = lay_out((self.name_of(p), p.shape) for p in params)
        if numel != buffer.numel():
            raise ValueError(f"bucket parameters hold {numel} elements, its buffer {buffer.numel()}")
        return slots

    def name_of(self, p: torch.Tensor) -> str:
        """The name of ``p`` (checked by shape against a pickled state's order)."""
        name = self.named.get(id(p))
        if name is None:
            i = len(self.named)
            if self.bind is None:
                name = f"param{i}"
            elif i >= len(self.bind) or tuple(self.bind[i][1]) != tuple(p.shape):
                expected = "no more parameters" if i >= len(self.bind) else f"{self.bind[i][0]!r} of shape {self.bind[i][1]}"
                raise ValueError(
                    f"this CommState was unpickled from a run whose parameter number {i} (in bucket order) was "
                    f"{expected}; this model's has shape {tuple(p.shape)}: register the hook of the same model, or build "
                    "a new state with commpress.register and load its state_dict()"
                )
            else:
                name = self.bind[i][0]
            self.named[id(p)] = name
        self.order.setdefault(name, tuple(p.shape))
        return name

    def check_picklable(self) -> None:
        """Refuse to pickle a model's names before any bucket: a copy could not map them yet."""
        if self.named and not self.order and self.bind is None:
            raise TypeError(
                "a CommState built with model= pickles only after its first reduction: until then its copy could not "
                "tell which parameter bears which name (overrides and per-tensor settings follow names); build it "
                "without model= (a config without overrides), or build it in each process after the model"
            )

    def pickled_order(self) -> list[tuple[str, tuple[int, ...]]] | None:
        """The order a pickled copy binds names by (None: no bucket seen, bind on first use)."""
        return list(self.order.items()) or self.bind
