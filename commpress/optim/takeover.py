"""Taking over an optimizer's step through its step hooks, what 1-bit Adam and Dion share.

The step pre-hook applies the method's update and hides the gradients of the parameters it
stepped, so the optimizer's own step skips them; the post-hook gives them back. The method's
engine (1-bit Adam's momentum average, Dion's iteration) reduces DDP's buckets and counts the steps.
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations.

from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from commpress.comm.pickling import BoundToProcess
from commpress.hooks.removable import CommHookSwitch, register_removable_hook

__all__ = ["Engine", "StepTakeover"]


class Engine(Protocol):
    """What reduces DDP's buckets for a step takeover and counts its steps (1-bit Adam's momentum
    average, Dion's iteration): the comm hook's state."""

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]: ...

    def stepped(self) -> None: ...


class StepTakeover(BoundToProcess):
    """A method that takes over ``optimizer.step()``: subclasses apply their update in
    :meth:`_pre_step` (then :meth:`_hide_grads`); their engine counts the step after it."""

    _engine: Engine | None = None
    _hooks: tuple[RemovableHandle, ...] = ()
    _switch: CommHookSwitch | None = None
    _hidden: tuple[tuple[torch.nn.Parameter, torch.Tensor | None], ...] = ()  # during the optimizer's step

    def _take_over(self, model: DistributedDataParallel, optimizer: Any, engine: Engine) -> None:
        """Register ``engine``'s reduction as ``model``'s comm hook (before its first backward) and ``optimizer``'s step hooks."""
        self._engine = engine
        self._switch = register_removable_hook(model, engine, comm_hook)
        self._hooks = (
            optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._pre_step()),
            optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self._post_step()),
        )

    def detach(self) -> None:
        """Take off what :meth:`attach` registered: DDP and the optimizer's step are their own again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = ()
        if self._switch is not None:
            self._switch.remove()

    def _pre_step(self) -> None:
        raise NotImplementedError

    def _hide_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """The optimizer's own step skips ``params``: this step has moved them."""
        self._hidden = tuple((p, p.grad) for p in params)
        for p, _ in self._hidden:
            p.grad = None

    def _post_step(self) -> None:
        for p, grad in self._hidden:
            p.grad = grad
        self._hidden = ()
        assert self._engine is not None  # the hooks are registered with it
        self._engine.stepped()


def comm_hook(engine: Engine, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook of a step takeover: the bucket's reduction where its engine runs it."""
    return engine.reduce(bucket)
