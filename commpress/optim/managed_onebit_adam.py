"""1-bit Adam under a torchft ``Manager``: the compressed momentum average survives a lost
replica group.

Every optimizer step is one manager step, as for the DDP hook under a manager, and the
loop is torchft's (``OptimizerWrapper``: ``zero_grad()`` starts the quorum, ``step()``
steps only if ``should_commit()``). A failure must be able to un-commit the step, so
everything goes through the manager inside the backward pass, before ``should_commit()``:
during the warm-up the DDP hook averages the gradients exactly; after it, the hook first
turns each bucket's gradient into this replica's momentum ``beta1 * m + (1 - beta1) * g``
and averages that with the method, so ``p.grad`` holds the averaged momentum when the
optimizer steps. Both run through a :class:`~commpress.hooks.state.CommState` under the manager
whose ``start_iter`` is the warm-up; it keeps the method's state (committed with the step,
dropped with it) and heals a (re)joining replica. The step, if committed, is AdamW's own
in the warm-up and after it AdamW's update with the averaged momentum and the frozen
variance (:func:`~commpress.optim.onebit_adam.frozen_update`), the same update as
:class:`~commpress.optim.OneBitAdam`'s.

A healing replica adds nothing to the averages (its momentum is not formed: its optimizer
state is stale until the manager hands it a peer's, with the model, at ``should_commit()``)
and then applies the participants' average to that state, so it ends the step equal to
its peers. Its per-rank error feedback starts from zero.
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations.

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commpress.comm import Traffic
from commpress.config import Config
from commpress.hooks.state import CommState
from commpress.local_sgd.average import check_finite
from commpress.optim.onebit_adam import (
    AdamStepTakeover,
    adam_parameters,
    adam_state,
    check_adam,
    check_warmup,
    frozen_update,
)

__all__ = ["ManagedOneBitAdam"]


def managed_hook(state: "ManagedOneBitAdam", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook of 1-bit Adam under a manager: after the warm-up the bucket's gradient
    becomes this replica's momentum; then the step's average through the manager."""
    state.begin_bucket(bucket.buffer(), bucket.parameters())
    return state.comm.reduce(bucket.index(), bucket.buffer(), bucket.parameters(), advance=bucket.is_last())


class ManagedOneBitAdam(AdamStepTakeover):
    """1-bit Adam attached to ``optimizer`` (AdamW) of the ``model`` made by
    :func:`~commpress.hooks.managed_ddp.managed_ddp`, its averages through ``manager``: exact for
    ``warmup_steps`` committed steps, then the momentum with ``method`` and ``params``."""

    name = "1-bit Adam under a torchft Manager"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: DistributedDataParallel,
        manager: Any,
        warmup_steps: int,
        method: str,
        params: Mapping[str, Any] | None = None,
        key: str = "commpress_onebit_adam",
    ) -> None:
        check_adam(optimizer)
        check_warmup(warmup_steps)
        self.params = [p for _, p in adam_parameters(optimizer, model.module.named_parameters())]
        self.optimizer = optimizer
        self.manager = manager
        self.warmup_steps = warmup_steps
        config = Config(method=method, params=dict(params or {}), start_iter=warmup_steps)
        self.comm = CommState.of_part(config, model.module, manager=manager, key=key)
        self._group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        self._step: int | None = None  # the step whose backward ran, if it was past the warm-up

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen: the next step averages the momentum."""
        return self.comm.steps >= self.warmup_steps

    @property
    def traffic(self) -> Traffic:
        """Bytes this replica sent: the warm-up's gradients and the momenta."""
        return self.comm.traffic

    def attach(self, model: DistributedDataParallel) -> None:
        """Register the DDP comm hook on ``model`` and the optimizer's step hooks."""
        self._attach(model, managed_hook)

    def begin_bucket(self, buffer: torch.Tensor, params: list[torch.Tensor]) -> None:
        """Past the warm-up, write this replica's momentum of ``params`` over their gradients
        in ``buffer`` (a healing replica's stays: it counts as nothing)."""
        self.manager.wait_quorum()
        step = self.comm.steps
        self._step = step if step >= self.warmup_steps else None
        if self._step is None or not self.manager.is_participating():
            return
        offset = 0
        for p in params:
            grad = buffer[offset : offset + p.numel()].view(p.shape)
            beta1 = self._group_of[id(p)]["betas"][0]
            grad.copy_(self._state(p)["exp_avg"].clone().lerp_(grad, 1 - beta1))
            offset += p.numel()

    def _take_step(self) -> bool:
        """Past the warm-up (the step committed): AdamW's update with the averaged momentum
        in ``p.grad``."""
        if self._step is None:
            return False
        if any(p.grad is None for p in self.params):
            raise RuntimeError(
                f"{self.name}: a parameter has no gradient at step {self._step}; its averaged momentum is its "
                "gradient here: do not clear or skip gradients between backward() and step()"
            )
        # one host sync for all: the largest magnitude of each momentum (a NaN or an inf carries through)
        peaks = [torch.linalg.vector_norm(p.grad, ord=math.inf) for p in self.params if p.grad.numel()]
        if peaks:
            check_finite(torch.stack(peaks), self.name, self._step)
        for p in self.params:
            frozen_update(self._group_of[id(p)], self._state(p), p, p.grad, self._step - self.warmup_steps)
        return True

    def _stepped(self) -> None:
        self._step = None

    def _state(self, p: torch.nn.Parameter) -> dict[str, Any]:
        return adam_state(self.optimizer, p, self.warmup_steps, self.name)

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """The hook's state (the step and the method's error feedback); the momentum and the
        frozen variance are the optimizer's state, which the manager recovers with the model."""
        return self.comm.state_dict(full=full)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.comm.load_state_dict(state)
