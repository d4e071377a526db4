"""Deep Gradient Compression's accumulation (Lin et al., 2018) for Top-k.

Plain error feedback under a momentum optimizer releases a delayed gradient into the momentum,
which repeats it for many steps. DGC moves the momentum in front of the sparsification::

    u = m·u + g          momentum correction: the local momentum
    v = v + u            the local velocity, what is sparsified
    send top-k of v;     v = 0 and u = 0 where sent (momentum factor masking)

and the optimizer runs without momentum (:func:`commpress.hooks.optimizer.hand_over_momentum`).
Tensors sent whole keep exact momentum SGD: their average ``D`` updates ``U = m·U + D``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from commpress.compressors.base import ParamSlot
from commpress.compressors.wire.memory import ErrorMemory, Piece

__all__ = ["clip_local", "correct", "dense_momentum", "mask", "owed_velocity"]


def clip_local(grad: torch.Tensor, slots: Sequence[ParamSlot], clip_norm: float, world_size: int) -> torch.Tensor:
    """DGC's local clipping: a float32 copy of ``grad``, each tensor scaled to L2 norm at most
    ``clip_norm / sqrt(world_size)`` (no host sync; Inf/NaN stay non-finite)."""
    out = grad.to(torch.float32, copy=True)
    bound = clip_norm / math.sqrt(world_size)
    for s in slots:
        view = out.narrow(0, s.offset, s.numel)
        norm = torch.linalg.vector_norm(view)
        view.mul_((bound / (norm + 1e-6)).clamp(max=1.0))
    return out


def correct(
    memory: ErrorMemory, pieces: Sequence[Piece], grad: torch.Tensor, momentum: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Momentum correction: fresh flat ``(u, v)`` in the bucket's layout."""
    n = grad.numel()
    u_old, _ = memory.gather("momentum", pieces, n, grad.device)
    v_old, _ = memory.gather("velocity", pieces, n, grad.device)
    u = torch.add(grad, u_old.narrow(0, 0, n), alpha=momentum)
    v = torch.add(v_old.narrow(0, 0, n), u)
    return u, v


def mask(u: torch.Tensor, indices: torch.Tensor) -> None:
    """Momentum factor masking: clear ``u`` where values were sent."""
    u.index_fill_(0, indices.long(), 0.0)


def dense_momentum(memory: ErrorMemory, pieces: Sequence[Piece], average: torch.Tensor, momentum: float) -> torch.Tensor:
    """``U = m·U + D`` for the tensors sent whole (``average`` = D, in the dense layout)."""
    old, _ = memory.gather("momentum", pieces, average.numel(), average.device)
    return torch.add(average, old.narrow(0, 0, average.numel()), alpha=momentum)


def owed_velocity(entries: Mapping[str, Any], momentum: float) -> torch.Tensor | None:
    """What one tensor owes from its DGC state: ``v + m u``, the velocity plus the momentum's next
    contribution; None without either."""
    v, u = entries.get("velocity"), entries.get("momentum")
    if v is None or u is None:
        return v if u is None else u * momentum
    return v + u * momentum
