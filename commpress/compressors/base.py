"""The contract every compressor follows: pure algorithm code, written as a generator.

A compressor's :meth:`Compressor.reduce` does its local work, ``yield``s a collective
request (:class:`AllReduce` or :class:`AllGather`), receives the result, may yield again,
and finally writes the *averaged* gradient into the bucket. It never touches a process
group, so the same code runs on torch.distributed, MPI and the in-process simulated world.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from commpress.compressors.collectives import AllGather, AllReduce, Collective, Finite, ReduceScatter, Reduction, Transfer

__all__ = [
    "AllGather",
    "AllReduce",
    "Bucket",
    "Collective",
    "Compressor",
    "Context",
    "Finite",
    "ParamSlot",
    "ReduceScatter",
    "Reduction",
    "Transfer",
    "on_dense_copy",
]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient lives inside a bucket's flat buffer."""

    name: str
    shape: torch.Size
    offset: int

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Bucket:
    """A flat gradient buffer, the parameters it holds, and an index.

    Compressors key their state (error feedback, warm starts) on parameter names, so it
    survives DDP moving parameters between buckets; ``index`` only names a bucket whose
    single slot has no parameter name, and keys caches derived from the layout.
    """

    index: int
    buffer: torch.Tensor
    slots: Sequence[ParamSlot] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.buffer.dim() != 1:
            raise ValueError(f"Bucket.buffer must be 1-D, got shape {tuple(self.buffer.shape)}")
        if not self.slots:
            self.slots = (ParamSlot("flat", self.buffer.shape, 0),)
        end = max(s.offset + s.numel for s in self.slots)
        if end > self.buffer.numel():
            raise ValueError(f"Bucket slots reach element {end}, buffer has {self.buffer.numel()}")

    @property
    def layout(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(name, shape) of every slot (DDP rebuilds its buckets after the first step, so
        an index may change members)."""
        return tuple((s.name, tuple(s.shape)) for s in self.slots)

    def views(self) -> list[torch.Tensor]:
        """One view of the buffer per parameter, shaped like the parameter."""
        return [self.buffer.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots]

    @classmethod
    def from_tensors(cls, index: int, tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> Bucket:
        """Copy ``tensors`` into a new flat buffer (tests and simulations use this)."""
        names = list(names) if names is not None else [f"p{i}" for i in range(len(tensors))]
        slots, offset = [], 0
        for name, t in zip(names, tensors, strict=True):
            slots.append(ParamSlot(name, t.shape, offset))
            offset += t.numel()
        dtype = tensors[0].dtype if tensors else torch.float32
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, dtype=dtype)
        return cls(index, flat, tuple(slots))


def on_dense_copy(reduce: Callable[[Bucket, Context], Reduction], bucket: Bucket, ctx: Context) -> Reduction:
    """Run ``reduce`` on a contiguous copy of a strided ``bucket`` and write the average back
    (for compressors whose kernels need dense memory)."""
    dense = Bucket(bucket.index, bucket.buffer.contiguous(), bucket.slots)
    finite = yield from reduce(dense, ctx)
    bucket.buffer.copy_(dense.buffer)
    return finite


@dataclass(frozen=True)
class Context:
    """What a compressor may know about the world: its rank, the world size, the step."""

    rank: int
    world_size: int
    step: int


class Compressor(ABC):
    """A gradient compressor. Subclasses set ``name`` and implement :meth:`reduce`.

    Constructor keyword arguments are the method's config parameters; the registry
    validates names and types from the signature, the constructor checks ranges and
    raises :class:`commpress.config.ConfigError`.
    """

    name: ClassVar[str]
    #: Most collective rounds one ``reduce`` call yields (backends open one ordered
    #: channel per round).
    rounds: ClassVar[int] = 1
    #: Gradient dtypes this compressor accepts.
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    #: :meth:`state_dict` keys whose entries differ per rank (error feedback, residuals,
    #: local momentum); every other entry is the same on every rank. Checkpoints use it to
    #: refuse another rank's state and to carry state to a job of another world size.
    per_rank_state: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        """Average ``bucket.buffer`` over ranks in place, yielding the collectives needed;
        return whether the average is known finite (:data:`Finite`: True/False from the
        decode, None when unknown, so the caller checks the buffer).

        A stateful compressor only *stages* its state changes here (see :meth:`end_step`).
        """

    def end_step(self, commit: bool) -> None:  # noqa: B027  (a no-op unless the compressor keeps state)
        """Called once per training step after every reduction of that step finished.

        ``commit=True`` applies the state changes the step's reductions staged (error
        buffers, warm starts, step counters); ``commit=False`` discards them (a non-finite
        step the optimizer skips), so training continues exactly as if that step had not
        happened. Until then :meth:`state_dict` returns the last committed state. The caller
        calls it before the next step's first reduction. Stateless compressors: a no-op.
        """

    def check_dtype(self, bucket: Bucket) -> None:
        """Raise a clear error for a gradient dtype this compressor does not handle."""
        if bucket.buffer.dtype not in self.dtypes:
            accepted = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            raise TypeError(
                f"compressor {self.name!r} does not support gradient dtype "
                f"{str(bucket.buffer.dtype).removeprefix('torch.')}; accepted: {accepted}"
            )

    def state_dict(self) -> dict[str, Any]:
        """The committed state to checkpoint (tensors on the CPU); stateless compressors return ``{}``."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"compressor {self.name!r} holds no state, got keys {sorted(state)}")

    # ---- what the method sends, its knob, its state when the knob moves ---------------

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...] | None:
        """What ``slot`` (gradients of ``element_size`` bytes) adds to each collective one
        :meth:`reduce` issues: one :class:`Transfer` per collective, in order, the same kinds
        for every slot (zero bytes where it adds nothing; a mean over steps where the method
        alternates). The default, None: not modelled, so the traffic model runs the method
        once and records its collectives."""
        return None

    def transfers(self, slots: Sequence[ParamSlot], element_size: int = 4) -> tuple[Transfer, ...] | None:
        """The collectives one :meth:`reduce` of a bucket holding ``slots`` issues, with this
        rank's input bytes: per collective, the sum over the slots of
        :meth:`slot_transfers` (collectives of no bytes left out); None where a slot is not
        modelled."""
        per_slot = [self.slot_transfers(s, element_size) for s in slots]
        if any(t is None for t in per_slot):
            return None
        kinds = [t.kind for t in per_slot[0]] if per_slot else []
        if any([t.kind for t in ts] != kinds for ts in per_slot):
            raise ValueError(f"compressor {self.name!r}: slot_transfers gives other collectives for other slots")
        totals = [sum(ts[i].nbytes for ts in per_slot) for i in range(len(kinds))]
        return tuple(Transfer(kind, nbytes) for kind, nbytes in zip(kinds, totals, strict=True) if nbytes)

    def params_for_ratio(self, ratio: float, slots: Sequence[ParamSlot]) -> dict[str, Any]:
        """The parameters to change so that ``slots`` carry about ``ratio`` (in (0, 1)) of
        their float32 bytes: the method's knob (Top-k's ``ratio``, the low-rank ``rank``),
        whose bound on the bytes each method states. The default, ``{}``: no knob, the
        configured setting at every ratio. Given one slot, it is that tensor's own setting
        (a per-tensor plan); the mapping only has to grow with ``ratio``."""
        return {}

    def adapt_state(self, state: dict[str, Any], previous: Compressor) -> dict[str, Any]:
        """``state``, saved by ``previous`` (this method with other parameters), made
        loadable by this instance. The default: unchanged (state that does not depend on
        the parameters)."""
        return state
