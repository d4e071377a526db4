"""A registration's state for torch.distributed.checkpoint (DCP) with its model and optimizer.

DCP writes one copy of a tensor several ranks hold under the same key, wrong where
``[local_sgd]`` lets replicas drift apart between syncs: so the model and optimizer go under their
replica's key, and commpress's own state per rank (:class:`~commpress.comm.checkpoint.DCPState`).
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
    """A DCP ``Stateful``: ``{"rank<r>": ...}`` and ``{"replica<i>": {"model": ..., "optim": ...}}``,
    ``i`` this rank's rank in ``[local_sgd]``'s averaging group (without it, one ``"replica"``)."""

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
