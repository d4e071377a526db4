"""What the bandwidth layer needs from a backend beyond running reductions: :class:`Links`, a
communicator of its own for probes (so they never mix with reductions), and backends whose
``"domain"`` and ``"cross"`` scopes split the ranks as a plan says. Through
:class:`MeasurableBackend` that layer never touches torch.distributed itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from commpress.comm.backend import Backend

__all__ = ["Links", "MeasurableBackend", "Pending"]


class Pending(Protocol):
    """A started transfer."""

    def wait(self) -> Any: ...


class Links(ABC):
    """A communicator for measuring links: peers are its own rank numbers, ``ranks`` their
    global ones (for messages), and probe tensors live on ``device``."""

    rank: int
    world_size: int
    ranks: Sequence[int]
    device: torch.device

    @abstractmethod
    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Send ``tensor`` to ``peer``; returns when it is handed over."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Receive into ``tensor`` from ``peer``."""

    @abstractmethod
    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Pending:
        """Start sending ``tensor`` to ``peer``."""

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Pending:
        """Start receiving into ``tensor`` from ``peer``."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks in place (blocking)."""

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (picklable), on every rank."""


class MeasurableBackend(Backend):
    """A backend whose links can be measured and whose ranks split into domain and cross scopes."""

    @abstractmethod
    def links(self) -> Links:
        """A new :class:`Links` over this backend's ranks (every rank calls it)."""

    @abstractmethod
    def scoped(self, rounds: Mapping[str, int], scopes: Mapping[str, Sequence[Sequence[int]]]) -> Backend:
        """A new backend over the same ranks, ``scopes`` partitioning them for ``"domain"``/``"cross"``."""
