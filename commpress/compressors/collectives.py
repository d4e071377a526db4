"""The collectives a reduction may ask for, and the scope of ranks each one spans.

A compressor yields :class:`AllReduce` or :class:`AllGather` over the whole group (scope
``"world"``); the hierarchical reduction also yields :class:`ReduceScatter` and collectives
scoped to the ranks of one fast domain (``"domain"``) or to one rank per domain
(``"cross"``). A backend maps every scope to the communicator holding this rank's peers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["SCOPES", "AllGather", "AllReduce", "Collective", "ReduceScatter", "Reduction", "in_scope"]

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
# What ``reduce`` is: yields collectives, receives their results, returns nothing.
Reduction = Generator[Collective, Any, None]


def in_scope(reduction: Reduction, scope: Scope) -> Reduction:
    """Run ``reduction`` with every collective it yields moved to ``scope`` (e.g. a
    compressor written for the whole group, run across domains)."""
    try:
        request = next(reduction)
        while True:
            result = yield dataclasses.replace(request, scope=scope)
            request = reduction.send(result)
    except StopIteration:
        return
