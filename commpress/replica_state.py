"""A registration's state for torch.distributed.checkpoint (DCP) with the model and
optimizer it trains: ``dcp.save({"train": reg.stateful(model, optimizer)}, checkpoint_id=...)``,
and ``dcp.load`` of the same, built fresh, to resume.

DCP writes one copy of a tensor that several ranks hold under the same key (a plain tensor,
or a DTensor's shard at the same offset): right for DDP's replicas, wrong where
``[local_sgd]`` lets the replicas' models drift apart between syncs (each rank, or each
replica group of a sharded model): DCP would keep one replica's model for all. So the model
and optimizer go under their replica's key, as ``torch.distributed.checkpoint.state_dict``
gives them (sharded tensors stay sharded), and commpress's own state per rank as
:class:`~commpress.comm.checkpoint.DCPState` stores it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from commpress.comm.checkpoint import DCPState
from commpress.optim import HybridOptimizer

__all__ = ["ReplicaState"]


class ReplicaState:
    """A ``Stateful`` for DCP: ``{"rank<r>": ...}`` (the registration's state, as
    :class:`~commpress.comm.checkpoint.DCPState` keeps it) and ``{"replica<i>": {"model":
    ..., "optim": ...}}``, ``i`` this rank's replica (its rank in ``[local_sgd]``'s
    averaging group; one key, ``"replica"``, where every rank holds the same model)."""

    def __init__(
        self, registration: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | HybridOptimizer | None = None
    ) -> None:
        self.registration = registration
        self.commpress = DCPState(registration)
        self.model = model
        self.optimizers = (
            [] if optimizer is None else optimizer.optimizers if isinstance(optimizer, HybridOptimizer) else [optimizer]
        )

    def _replica_key(self) -> str:
        trainer = self.registration.local_sgd
        return "replica" if trainer is None else f"replica{trainer.averager.rank}"

    def state_dict(self) -> dict[str, Any]:
        if self.optimizers:
            model, optim = get_state_dict(self.model, self.optimizers)
            replica = {"model": model, "optim": optim}
        else:
            replica = {"model": get_model_state_dict(self.model)}
        return {**self.commpress.state_dict(), self._replica_key(): replica}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, on the same ranks and mesh."""
        saved = state[self._replica_key()]
        if self.optimizers:
            set_state_dict(self.model, self.optimizers, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
        else:
            set_model_state_dict(self.model, saved["model"])
        self.commpress.load_state_dict(state)
