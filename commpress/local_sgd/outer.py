"""The outer step of Local SGD, DiLoCo and CO2: SGD on the anchor (the model every rank
shares) with the averaged pseudo-gradient ``g = mean over ranks of (anchor - local)``.

    m = clamp(momentum * m + scale * g, -clip, clip)      (no m when momentum = 0 and no clip)
    u = scale * g + momentum * m  (nesterov)   or   m     (or scale * g without m)
    anchor = anchor - lr * u

Plain Local SGD is lr 1, momentum 0 (the anchor becomes the average of the local models);
DiLoCo is lr 0.7, momentum 0.9 with Nesterov (torch.optim.SGD's Nesterov step, dampening
0); CO2 is momentum without Nesterov, its staleness penalty as ``scale = 1 / Lambda`` and
element-wise clipping of ``m``. One flat momentum vector covers the whole model, so a
fragment's step updates its own slice.
"""

from __future__ import annotations

import torch

__all__ = ["OuterStep"]


class OuterStep:
    """The outer SGD step on ``anchor`` (a flat vector); ``momentum`` is ``m`` (a zero
    vector like the anchor, or None when the step keeps no state)."""

    def __init__(
        self,
        anchor: torch.Tensor,
        lr: float = 1.0,
        momentum: float = 0.0,
        nesterov: bool = False,
        clip: float | None = None,
    ) -> None:
        if nesterov and momentum == 0:
            raise ValueError("nesterov = true needs outer_momentum > 0")
        self.lr, self.beta, self.nesterov, self.clip = float(lr), float(momentum), nesterov, clip
        self.momentum = torch.zeros_like(anchor) if momentum > 0 or clip is not None else None

    def apply(self, anchor: torch.Tensor, grad: torch.Tensor, where: slice = slice(None), scale: float = 1.0) -> None:
        """One step of ``anchor[where]`` with the averaged pseudo-gradient ``grad`` (that
        slice's, changed in place when ``scale`` is not 1)."""
        part = anchor[where]
        if self.momentum is None:
            if scale != 1.0:
                grad.mul_(scale)
            part.sub_(grad, alpha=self.lr)
            return
        m = self.momentum[where]
        m.mul_(self.beta).add_(grad, alpha=scale)
        if self.clip is not None:
            m.clamp_(-self.clip, self.clip)
        if not self.nesterov:
            part.sub_(m, alpha=self.lr)
            return
        if scale != 1.0:
            grad.mul_(scale)
        part.sub_(grad.add_(m, alpha=self.beta), alpha=self.lr)
