"""The contract every compressor follows: pure algorithm code, written as a generator.

:meth:`Compressor.reduce` yields collective requests (:class:`AllReduce`, :class:`AllGather`),
receives their results and writes the *averaged* gradient into the bucket. It never touches a
process group, so the same code runs on torch.distributed, MPI and the simulated world.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from commpress.compressors.tensor_stats import TensorStats
from commpress.compressors.wire.collectives import AllGather, AllReduce, Collective, Finite, ReduceScatter, Reduction, Transfer

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
    "Setting",
    "Transfer",
    "lay_out",
    "over_tensors",
    "without_per_rank",
]

#: (method, params): one setting of a method, as a config names it.
Setting = tuple[str, dict[str, Any]]


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
    """A flat gradient buffer, the parameters it holds, and an index. State is keyed on parameter
    names, surviving DDP's regrouping; ``index`` names an unnamed bucket and keys layout caches."""

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
        """(name, shape) of every slot: DDP rebuilds buckets after the first step, so an index may change members."""
        return tuple((s.name, tuple(s.shape)) for s in self.slots)

    def views(self) -> list[torch.Tensor]:
        """One view of the buffer per parameter, shaped like the parameter."""
        return [self.buffer.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots]

    @classmethod
    def from_tensors(cls, index: int, tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> Bucket:
        """Copy ``tensors`` into a new flat buffer (tests and simulations use this)."""
        names = list(names) if names is not None else [f"p{i}" for i in range(len(tensors))]
        slots, _ = lay_out((name, t.shape) for name, t in zip(names, tensors, strict=True))
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float32)
        return cls(index, flat, slots)


def lay_out(named: Iterable[tuple[str, Sequence[int]]]) -> tuple[tuple[ParamSlot, ...], int]:
    """The slots of tensors (name, shape) laid end to end from offset 0, and their total elements."""
    slots: list[ParamSlot] = []
    offset = 0
    for name, shape in named:
        slots.append(ParamSlot(name, torch.Size(shape), offset))
        offset += slots[-1].numel
    return tuple(slots), offset


TensorReduce = Callable[[Any, "Bucket", "Context", list[ParamSlot]], Reduction]


def over_tensors(reduce: TensorReduce) -> Callable[[Any, Bucket, Context], Reduction]:
    """Make ``reduce(self, bucket, ctx, slots)``, given the non-empty slots, a compressor's ``reduce``:
    the dtype is checked, and a strided bucket is reduced on a contiguous copy (kernels need dense memory)."""

    @functools.wraps(reduce)
    def wrapper(self: Compressor, bucket: Bucket, ctx: Context) -> Reduction:
        self.check_dtype(bucket)
        if not bucket.buffer.is_contiguous():
            dense = Bucket(bucket.index, bucket.buffer.contiguous(), bucket.slots)
            finite = yield from wrapper(self, dense, ctx)
            bucket.buffer.copy_(dense.buffer)
            return finite
        slots = [s for s in bucket.slots if s.numel]
        if not slots:
            return None
        return (yield from reduce(self, bucket, ctx, slots))

    return wrapper


@dataclass(frozen=True)
class Context:
    """What a compressor may know about the world: its rank, the world size, the step."""

    rank: int
    world_size: int
    step: int


class Compressor(ABC):
    """A gradient compressor. Subclasses set ``name`` and implement :meth:`reduce`.

    Constructor keyword arguments are the method's config parameters; their type hints say what
    each accepts, ranges included (``Annotated[float, Bounds(gt=0, le=1)]``). The registry checks
    names, types and ranges before the constructor runs, so it checks only rules between
    parameters; every refusal is a :class:`commpress.config.ConfigError`.

    The rest of the package never names a method; it asks only what this class declares:
    ``rounds``, ``dtypes``, ``per_rank_state``, the step commit and checkpoints, what is sent and
    the knob (the bandwidth layer), what a layer-wise plan weighs, the optimizer's momentum, and
    :attr:`skip_last_layer` (the method groups).
    """

    name: ClassVar[str]
    #: Most collective rounds one ``reduce`` yields (backends open one ordered channel per round).
    rounds: ClassVar[int] = 1
    #: Gradient dtypes this compressor accepts.
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    #: :meth:`state_dict` keys whose entries differ per rank (residuals, local momentum); checkpoints
    #: use it to refuse another rank's state and to move state to another world size.
    per_rank_state: ClassVar[tuple[str, ...]] = ()
    #: The parameter :meth:`params_for_ratio` sets (Top-k's ``ratio``, low-rank ``rank``); None: no knob.
    knob: ClassVar[str | None] = None
    #: The momentum this compressor applies (:attr:`applies_momentum`), configured or handed over
    #: from the optimizer by the hooks; None otherwise.
    momentum: float | None = None
    #: Whether the model's last layer is left to an exact average (the method groups find it).
    skip_last_layer: bool = False

    @abstractmethod
    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        """Average ``bucket.buffer`` over ranks in place, yielding the collectives needed; return
        :data:`Finite`. State changes are only *staged* here (see :meth:`end_step`)."""

    def end_step(self, commit: bool) -> None:  # noqa: B027  (a no-op unless the compressor keeps state)
        """Called once per step, after all its reductions: apply (``commit``) or discard the staged
        state; discarding (a step the optimizer skips) continues as if the step never happened."""

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

    # ---- what the method sends, its knob, its state when the knob moves (bandwidth layer)

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...] | None:
        """What ``slot`` adds to each collective of one :meth:`reduce`, the same kinds for every slot
        (a mean where the method alternates). None: not modelled, the traffic model runs the method."""
        return None

    def transfers(self, slots: Sequence[ParamSlot], element_size: int = 4) -> tuple[Transfer, ...] | None:
        """This rank's input bytes per collective of one :meth:`reduce` over ``slots`` (summed
        :meth:`slot_transfers`, empty collectives left out); None where a slot is not modelled."""
        per_slot = [self.slot_transfers(s, element_size) for s in slots]
        if any(t is None for t in per_slot):
            return None
        kinds = [t.kind for t in per_slot[0]] if per_slot else []
        if any([t.kind for t in ts] != kinds for ts in per_slot):
            raise ValueError(f"compressor {self.name!r}: slot_transfers gives other collectives for other slots")
        totals = [sum(ts[i].nbytes for ts in per_slot) for i in range(len(kinds))]
        return tuple(Transfer(kind, nbytes) for kind, nbytes in zip(kinds, totals, strict=True) if nbytes)

    def params_for_ratio(self, ratio: float, slots: Sequence[ParamSlot]) -> dict[str, Any]:
        """The knob setting under which ``slots`` carry about ``ratio`` of their float32 bytes (``{}``: no
        knob); given one slot, that tensor's own. It only has to grow with ``ratio``."""
        return {}

    def adapt_state(self, state: dict[str, Any], previous: Compressor) -> dict[str, Any]:
        """``state`` saved by ``previous`` (this method, other parameters) made loadable here; default unchanged."""
        return state

    # ---- the optimizer's momentum ------------------------------------------------------

    @property
    def applies_momentum(self) -> bool:
        """Whether this compressor applies the optimizer's momentum before compressing (DGC); the
        hooks then hand it over (:attr:`momentum`) and the optimizer runs without momentum."""
        return False

    # ---- what a layer-wise plan weighs -------------------------------------------------

    def ladder(self, params: Mapping[str, Any]) -> list[Setting] | None:
        """The settings a layer-wise plan may give this method's tensors, the configured ``params``
        first, then its knob around it and other methods' (:func:`commpress.compressors.ladder.pool`).
        None: ``[layerwise]`` does not plan this method's tensors."""
        return None

    def error_model(self, tensor: TensorStats) -> Callable[[], float] | None:
        """What this setting loses on one tensor: the squared L2 distance between what it owes
        (gradient plus :meth:`owed`) and what is sent, as a function to call once every candidate
        has asked ``tensor`` for the statistics it will read. None: no error model."""
        return None

    def owed(self, entries: Mapping[str, Any]) -> torch.Tensor | None:
        """What one tensor owes beyond its next gradient (its error-feedback residual), from its
        :meth:`state_dict` entries; a plan moving it to another method adds it. None: nothing."""
        return None

    def takes_state_of(self, previous: Compressor) -> bool:
        """Whether :meth:`adapt_state` converts ``previous``'s state (else a plan moves what is owed)."""
        return type(previous) is type(self)


def without_per_rank(compressor: Compressor, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with its per-rank entries emptied: what all ranks share, and what a replica healing
    from a peer receives (its error feedback restarts from zero)."""
    return {k: ({} if k in compressor.per_rank_state else v) for k, v in state.items()}
