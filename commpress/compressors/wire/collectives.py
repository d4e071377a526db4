"""The collectives a reduction may ask for, and the scope of ranks each one spans.

A compressor yields :class:`AllReduce` or :class:`AllGather` over the whole group (scope
``"world"``); the hierarchical reduction also yields :class:`ReduceScatter` and collectives
scoped to the ranks of one fast domain (``"domain"``) or to one rank per domain
(``"cross"``). A backend maps every scope to the communicator holding this rank's peers.

A :class:`Transfer` describes a collective by its kind and size alone: what a
compressor's wire model (:meth:`~commpress.compressors.base.Compressor.transfers`) and the
traffic model speak in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "SCOPES",
    "AllGather",
    "AllReduce",
    "Collective",
    "Finite",
    "ReduceScatter",
    "Reduction",
    "Transfer",
    "in_scope",
    "relayed",
    "sum_rows",
]

#: Scopes a collective may span: every rank, the ranks of this rank's fast domain, or the
#: ranks of this rank's cross-domain group (one per domain).
SCOPES = ("world", "domain", "cross")
Scope = Literal["world", "domain", "cross"]


@dataclass
class AllReduce:
    """Reduce ``tensor`` over the scope's ranks; the result (same shape and dtype) is sent
    back. ``op`` is ``"sum"`` (the default) or ``"max"``."""

    tensor: torch.Tensor
    op: Literal["sum", "max"] = "sum"
    scope: Scope = "world"

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class AllGather:
    """Gather ``tensor`` (1-D, the same size on every rank of the scope); the list of all
    ranks' tensors is sent back."""

    tensor: torch.Tensor
    scope: Scope = "world"

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class ReduceScatter:
    """``tensor`` (1-D) holds one equal chunk per rank of the scope; rank ``j`` gets back the
    sum over ranks of chunk ``j``, summed in rank order (reproducible)."""

    tensor: torch.Tensor
    scope: Scope = "world"

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


Collective = AllReduce | AllGather | ReduceScatter
#: Whether a reduction knows the average it wrote is finite: True or False from its decode,
#: None when it does not know (the hook then checks the buffer itself).
Finite = bool | None
# What ``reduce`` is: yields collectives, receives their results, returns what it knows of
# the average (composition with ``yield from`` carries it).
Reduction = Generator[Collective, Any, Finite]


def sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """The sum of ``rows`` (one per rank) taken in row order: the order every backend adds
    ranks in, so sums are reproducible and alike on all of them."""
    first, *rest = rows.unbind(0)
    total = first.clone()
    for row in rest:
        total += row
    return total


Kind = Literal["all_reduce", "all_gather", "all_to_all"]


@dataclass(frozen=True)
class Transfer:
    """One collective as one rank issues it: its kind and its input's bytes (what a
    backend's ``Traffic`` counts). A :class:`ReduceScatter` is an ``"all_to_all"``."""

    kind: Kind
    nbytes: float

    @classmethod
    def of(cls, request: Collective) -> Transfer:
        """The transfer of a collective a reduction yields."""
        kinds: dict[type, Kind] = {AllGather: "all_gather", ReduceScatter: "all_to_all"}
        return cls(kinds.get(type(request), "all_reduce"), request.nbytes)

    def wire_bytes(self, n: int) -> float:
        """Bytes this rank sends in a group of ``n`` ranks, by gloo's algorithms: ring
        all-reduce ``2(n-1)/n`` of the input, ring all-gather ``n-1`` times it, all-to-all
        ``(n-1)/n`` of it."""
        if n < 2:
            return 0.0
        return {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "all_to_all": (n - 1) / n}[self.kind] * self.nbytes

    def messages(self, n: int) -> int:
        """Messages one after another (each pays the latency once)."""
        if n < 2 or not self.nbytes:
            return 0
        return 2 * (n - 1) if self.kind == "all_reduce" else n - 1


def relayed(
    reduction: Reduction,
    before: Callable[[Collective], Collective] | None = None,
    after: Callable[[Collective, Any], None] | None = None,
) -> Reduction:
    """Run ``reduction`` with each collective it yields passed through ``before`` on its way
    out (which may replace it) and handed to ``after`` with its result on the way back: the
    one place where a reduction is watched or rewritten between it and its backend."""
    try:
        request = next(reduction)
        while True:
            sent = before(request) if before else request
            result = yield sent
            if after:
                after(sent, result)
            request = reduction.send(result)
    except StopIteration as done:
        return done.value


def in_scope(reduction: Reduction, scope: Scope) -> Reduction:
    """Run ``reduction`` with every collective it yields moved to ``scope`` (e.g. a
    compressor written for the whole group, run across domains)."""
    return relayed(reduction, before=lambda request: dataclasses.replace(request, scope=scope))
