"""What the bandwidth layer needs from a backend beyond running reductions.

Measuring the links takes point-to-point transfers and blocking collectives on a
communicator of their own, so probes never mix with reductions (:class:`Links`). Reducing
hierarchically takes a backend over the same ranks whose ``"domain"`` and ``"cross"``
scopes split them as a plan says. A :class:`MeasurableBackend` offers both; the layer
above asks for nothing else, so it never touches torch.distributed itself.
:class:`~commpress.comm.torch_backend.TorchBackend` is one.
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
    """A communicator of ``world_size`` ranks for measuring the links between them.

    Peers are ranks of this communicator (``0 .. world_size - 1``); ``ranks`` are their
    global ranks (for messages); probe tensors live on ``device``. Every rank calls the
    collectives together; ``send``/``recv`` pair up as the caller arranges.
    """

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
    """A backend whose links can be measured and whose ranks can be split into domain
    and cross scopes: what the bandwidth layer runs on."""

    @abstractmethod
    def links(self) -> Links:
        """A new communicator of this backend's ranks for measuring links; every rank
        calls it together."""

    @abstractmethod
    def scoped(self, rounds: Mapping[str, int], scopes: Mapping[str, Sequence[Sequence[int]]]) -> Backend:
        """A new backend over the same ranks: ``rounds`` collectives per scope,
        ``scopes`` partitions of the ranks (this backend's rank numbers) for ``"domain"``
        and ``"cross"``. Every rank calls it together."""
