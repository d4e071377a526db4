"""The collectives a reduction may ask for, and the scope of ranks each one spans.

Compressors yield collectives over the whole group (``"world"``); the hierarchical reduction also
scopes them to one fast domain (``"domain"``) or one rank per domain (``"cross"``). A
:class:`Transfer` (kind and size alone) is what the wire and traffic models speak in.
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

#: Scopes a collective may span: every rank, this rank's fast domain, or its cross-domain group.
SCOPES = ("world", "domain", "cross")
Scope = Literal["world", "domain", "cross"]


class _Request:
    """What every collective request holds: its ``tensor``, sent from this rank."""

    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class AllReduce(_Request):
    """Reduce ``tensor`` over the scope's ranks; the result (same shape and dtype) is sent back."""

    tensor: torch.Tensor
    op: Literal["sum", "max"] = "sum"
    scope: Scope = "world"


@dataclass
class AllGather(_Request):
    """Gather ``tensor`` (1-D, the same size on every rank); the list of all ranks' tensors is sent back."""

    tensor: torch.Tensor
    scope: Scope = "world"


@dataclass
class ReduceScatter(_Request):
    """``tensor`` (1-D) holds one chunk per rank; rank ``j`` gets back chunk ``j`` summed in rank order."""

    tensor: torch.Tensor
    scope: Scope = "world"


Collective = AllReduce | AllGather | ReduceScatter
#: Whether a reduction knows its average finite; None: unknown, the hook checks the buffer.
Finite = bool | None
# ``reduce``: yields collectives, receives results, returns what it knows of the average
Reduction = Generator[Collective, Any, Finite]


def sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """The sum of ``rows`` (one per rank) in row order, as every backend adds them: reproducible."""
    first, *rest = rows.unbind(0)
    total = first.clone()
    for row in rest:
        total += row
    return total


Kind = Literal["all_reduce", "all_gather", "all_to_all"]


@dataclass(frozen=True)
class Transfer:
    """One collective as one rank issues it: its kind and input bytes. A :class:`ReduceScatter` is ``"all_to_all"``."""

    kind: Kind
    nbytes: float

    @classmethod
    def of(cls, request: Collective) -> Transfer:
        """The transfer of a collective a reduction yields."""
        kinds: dict[type, Kind] = {AllGather: "all_gather", ReduceScatter: "all_to_all"}
        return cls(kinds.get(type(request), "all_reduce"), request.nbytes)

    def wire_bytes(self, n: int) -> float:
        """Bytes this rank sends in a group of ``n`` ranks, by gloo's ring and all-to-all algorithms."""
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
    """Run ``reduction``, passing each collective through ``before`` (which may replace it) and,
    with its result, to ``after``: the one place a reduction is watched or rewritten."""
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
    """Run ``reduction`` with every collective moved to ``scope`` (a compressor run across domains)."""
    return relayed(reduction, before=lambda request: dataclasses.replace(request, scope=scope))
