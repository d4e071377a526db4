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
        slots, _ = lay_out((name, t.shape) for name, t in zip(names, tensors, strict=True))
        dtype = tensors[0].dtype if tensors else torch.float32
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0, dtype=dtype)
        return cls(index, flat, slots)


def lay_out(named: Iterable[tuple[str, Sequence[int]]]) -> tuple[tuple[ParamSlot, ...], int]:
    """The slots of tensors (name, shape) laid end to end in a flat buffer, in order from
    offset 0, and the elements they hold: a bucket's layout, a flat model's."""
    slots: list[ParamSlot] = []
    offset = 0
    for name, shape in named:
        slots.append(ParamSlot(name, torch.Size(shape), offset))
        offset += slots[-1].numel
    return tuple(slots), offset


TensorReduce = Callable[[Any, "Bucket", "Context", list[ParamSlot]], Reduction]


def over_tensors(reduce: TensorReduce) -> Callable[[Any, Bucket, Context], Reduction]:
    """A compressor's ``reduce`` from one over a bucket's non-empty tensors: the decorated
    method is called as ``reduce(self, bucket, ctx, slots)`` with the slots that hold
    elements, after the gradient dtype is checked (:meth:`Compressor.check_dtype`); a
    bucket without elements is left as it is, and a strided one is reduced on a contiguous
    copy whose average is written back (for kernels that need dense memory)."""

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

    Constructor keyword arguments are the method's config parameters, their type hints
    what each accepts, a number's range included (``ratio: Annotated[float, Bounds(gt=0,
    le=1)]``): the registry checks names, types and ranges from the signature before the
    constructor runs, which checks only rules between parameters; every refusal is a
    :class:`commpress.config.ConfigError`.

    What the rest of the package may ask a compressor, and nothing else (it never names a
    method): ``rounds``, ``dtypes`` and ``per_rank_state`` (backends, hooks, checkpoints);
    :meth:`end_step`, :meth:`state_dict` and :meth:`load_state_dict` (the step's commit,
    checkpoints); what it sends, its knob and its state when the knob moves
    (:meth:`transfers`, :attr:`knob`, :meth:`params_for_ratio`, :meth:`adapt_state`: the
    bandwidth layer); the settings and errors a layer-wise plan weighs (:meth:`ladder`,
    :meth:`error_model`, :meth:`owed`, :meth:`takes_state_of`); whether the optimizer hands
    it its momentum (:attr:`applies_momentum`, :attr:`momentum`); whether it leaves the
    model's last layer to exact averaging (:attr:`skip_last_layer`: the method groups).
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
    #: The parameter a target ratio sets (the key :meth:`params_for_ratio` returns: Top-k's
    #: ``ratio``, the low-rank ``rank``), by which a layer-wise setting is labelled; None: no knob.
    knob: ClassVar[str | None] = None
    #: The momentum this compressor applies (:attr:`applies_momentum`): configured, or
    #: handed over from the optimizer by the hooks; None until then, and for every other.
    momentum: float | None = None
    #: Whether the model's last layer is left out of this compressor, to an exact average
    #: (the method groups find that layer, so they need the model).
    skip_last_layer: bool = False

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

    # ---- the optimizer's momentum ------------------------------------------------------

    @property
    def applies_momentum(self) -> bool:
        """Whether this compressor applies the optimizer's momentum itself, before it
        compresses (DGC's momentum correction): the optimizer then runs without momentum,
        and the hooks hand the optimizer's over (:attr:`momentum`). The default: False."""
        return False

    # ---- what a layer-wise plan weighs -------------------------------------------------

    def ladder(self, params: Mapping[str, Any]) -> list[Setting] | None:
        """The settings a layer-wise plan may give a tensor of this method, configured with
        ``params`` (those this instance was built with), the configured one first: its own
        knob around it, and other methods' settings (:func:`commpress.compressors.ladder.pool`).
        The default, None: ``[layerwise]`` does not plan this method's tensors."""
        return None

    def error_model(self, tensor: TensorStats) -> Callable[[], float] | None:
        """What this setting loses on one tensor, as a function to call once every
        candidate's model has been made: the squared L2 distance between what the tensor
        owes (its gradient, plus what :meth:`owed` returns) and what this setting sends of
        it, on this rank, read off ``tensor``'s shared statistics (a model asks there first
        for the counts and ranks it will read). The default, None: no error model."""
        return None

    def owed(self, entries: Mapping[str, Any]) -> torch.Tensor | None:
        """What one tensor owes beyond its next gradient, from its entries of
        :meth:`state_dict` (state key -> tensor): the residual that error feedback carries,
        added to its next gradient when a plan moves it to another method. The default:
        None (it owes nothing)."""
        return None

    def takes_state_of(self, previous: Compressor) -> bool:
        """Whether :meth:`adapt_state` converts the state of ``previous`` (a plan then moves
        a tensor's entries rather than what it owes). The default: the same class."""
        return type(previous) is type(self)


def without_per_rank(compressor: Compressor, state: Mapping[str, Any]) -> dict[str, Any]:
    """``compressor``'s ``state`` with its per-rank entries (:attr:`Compressor.per_rank_state`)
    emptied: what every rank shares, and what a replica that heals from a peer receives (its
    error feedback starts from zero)."""
    return {k: ({} if k in compressor.per_rank_state else v) for k, v in state.items()}
