"""A registration's state for torch.distributed.checkpoint (DCP), with the training state
it belongs to: ``dcp.save({"train": reg.stateful(model, optimizer)}, checkpoint_id=...)``,
and ``dcp.load`` of the same dict, built fresh, to resume.

DCP writes one copy of a tensor that several ranks hold under the same key (a plain tensor,
or a DTensor's shard at the same offset): right for DDP's replicas, wrong for state that
differs by rank. So commpress's state goes in whole, one serialized value per rank (error
feedback, a shard's anchor, lazily made entries included); and where ``[local_sgd]`` lets
the replicas' models drift apart between syncs (each rank, or each replica group of a
sharded model), the model and optimizer go under their replica's key, as
``torch.distributed.checkpoint.state_dict`` gives them (sharded tensors stay sharded).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = ["DCPState"]


class DCPState:
    """A ``Stateful`` for DCP: ``{"rank<r>": bytes}`` (this rank's
    ``registration.state_dict()``), and with ``model`` ``{"replica<i>": {"model": ...,
    "optim": ...}}`` (``i``: this rank's replica, its rank in ``[local_sgd]``'s averaging
    group; one key, ``"replica"``, where every rank holds the same model)."""

    def __init__(self, registration: Any, model: torch.nn.Module | None = None, optimizer: Any = None) -> None:
        if optimizer is not None and model is None:
            raise ValueError("DCPState: optimizer is accepted with model only (its state is keyed by the model's parameters)")
        self.registration = registration
        self.model = model
        self.optimizers = [] if optimizer is None else [optimizer]

    def _rank_key(self) -> str:
        return f"rank{dist.get_rank()}"

    def _replica_key(self) -> str:
        trainer = self.registration.local_sgd
        return "replica" if trainer is None else f"replica{trainer.averager.rank}"

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.registration.state_dict(), buffer)
        out: dict[str, Any] = {self._rank_key(): buffer.getvalue()}
        if self.model is not None and self.optimizers:
            model, optim = get_state_dict(self.model, self.optimizers)
            out[self._replica_key()] = {"model": model, "optim": optim}
        elif self.model is not None:
            out[self._replica_key()] = {"model": get_model_state_dict(self.model)}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, on the same ranks and mesh."""
        key = self._rank_key()
        if key not in state:
            raise ValueError(f"the commpress state holds {', '.join(state)}, not {key}: load it on the same ranks")
        if self.model is not None:
            saved = state[self._replica_key()]
            if self.optimizers:
                set_state_dict(self.model, self.optimizers, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
            else:
                set_model_state_dict(self.model, saved["model"])
        self.registration.load_state_dict(torch.load(io.BytesIO(state[key]), weights_only=True))
