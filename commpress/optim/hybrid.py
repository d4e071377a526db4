"""Several torch optimizers over disjoint parameters taking one iteration together, such as Muon
on the hidden matrices and AdamW on the rest (the nanochat / modded-nanogpt split).

``commpress.register(model, cfg, optimizer=[muon, adamw])`` wraps the list in a
:class:`HybridOptimizer`, whose iteration ends once every optimizer has stepped, in any order:
tables that run at the step (``[local_sgd]``) work while the loop stays ``muon.step(); adamw.step()``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from commpress.errors import ConfigError

__all__ = ["HybridOptimizer", "as_optimizer", "check_step_hooks", "describe"]

StepHook = Callable[[Any, tuple[Any, ...], dict[str, Any]], None]


def describe(optimizer: torch.optim.Optimizer) -> str:
    """How messages name an optimizer: its class and what it covers."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return f"{type(optimizer).__name__} over {len(params)} parameters ({sum(p.numel() for p in params):,} numbers)"


def check_step_hooks(optimizer: Any, needs: str) -> None:
    """Refuse an optimizer without torch's step hook tables, which ``needs`` (the message's subject)
    runs from: a wrapper that skips ``torch.optim.Optimizer.__init__``, such as Accelerate's."""
    if not isinstance(optimizer, HybridOptimizer) and not hasattr(optimizer, "_optimizer_step_post_hooks"):
        raise TypeError(
            f"{needs} runs at the optimizer's step hooks, which this {type(optimizer).__name__} does not hold "
            "(a wrapper: Accelerate's AcceleratedOptimizer, for one): pass the torch.optim optimizer it wraps "
            "(optimizer.optimizer)"
        )


def as_optimizer(optimizer: Any) -> Any:
    """``register(..., optimizer=)``'s value as one optimizer: several become a :class:`HybridOptimizer`."""
    if isinstance(optimizer, (list, tuple)):
        return optimizer[0] if len(optimizer) == 1 else HybridOptimizer(optimizer)
    return optimizer


class HybridOptimizer:
    """``optimizers`` stepping disjoint parameters as one iteration.

    Step hooks run before its first step and after its last, in whatever order the loop steps them;
    while one is registered, an optimizer stepping twice before the others raises, as the
    iteration would never end.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        if len(self.optimizers) < 2:
            raise ConfigError(f"optimizer = a list of {len(self.optimizers)}; expected one optimizer or a list of several")
        seen: dict[int, int] = {}
        for i, opt in enumerate(self.optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizer[{i}] is a {type(opt).__name__}; expected a torch.optim.Optimizer")
            check_step_hooks(opt, f"a HybridOptimizer (its optimizer[{i}])")
            for group in opt.param_groups:
                for p in group["params"]:
                    if seen.setdefault(id(p), i) != i:
                        raise ConfigError(
                            f"optimizer[{i}] ({describe(opt)}) steps a parameter of shape {tuple(p.shape)} that "
                            f"optimizer[{seen[id(p)]}] also steps; expected optimizers over disjoint parameters"
                        )
        self._stepped: list[int] = []
        self._pre: OrderedDict[int, StepHook] = OrderedDict()  # RemovableHandle holds a weak reference
        self._post: OrderedDict[int, StepHook] = OrderedDict()
        self._member_hooks = [
            handle
            for i, opt in enumerate(self.optimizers)
            for handle in (
                opt.register_step_pre_hook(lambda o, args, kwargs, i=i: self._member_begins(i, args, kwargs)),
                opt.register_step_post_hook(lambda o, args, kwargs, i=i: self._member_ends(i, args, kwargs)),
            )
        ]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Every optimizer's step, in order (a closure runs once, for the first)."""
        loss = self.optimizers[0].step(closure)
        for opt in self.optimizers[1:]:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"the state holds {len(saved)} optimizers; this HybridOptimizer has {len(self.optimizers)}")
        for opt, s in zip(self.optimizers, saved):
            opt.load_state_dict(s)

    def register_step_pre_hook(self, hook: StepHook) -> RemovableHandle:
        """``hook(self, args, kwargs)`` before the iteration's first optimizer step."""
        return self._add(self._pre, hook)

    def register_step_post_hook(self, hook: StepHook) -> RemovableHandle:
        """``hook(self, args, kwargs)`` after the iteration's last optimizer step."""
        return self._add(self._post, hook)

    def remove_hooks(self) -> None:
        """Take this object's hooks off its optimizers."""
        for handle in self._member_hooks:
            handle.remove()

    def _add(self, hooks: OrderedDict[int, StepHook], hook: StepHook) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    @property
    def _watched(self) -> bool:
        """Whether a hook waits for the iteration: only then is it tracked."""
        return bool(self._pre or self._post)

    def _member_begins(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._watched:
            self._stepped = []
            return
        if i in self._stepped:
            waiting = ", ".join(
                f"optimizer[{j}] ({describe(o)})" for j, o in enumerate(self.optimizers) if j not in self._stepped
            )
            raise RuntimeError(
                f"optimizer[{i}] ({describe(self.optimizers[i])}) steps again before {waiting} stepped: an iteration "
                "ends when every optimizer of the HybridOptimizer has stepped once; step each once per iteration"
            )
        if not self._stepped:
            for hook in list(self._pre.values()):
                hook(self, args, kwargs)

    def _member_ends(self, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._watched:
            return
        self._stepped.append(i)
        if len(self._stepped) == len(self.optimizers):
            self._stepped = []
            for hook in list(self._post.values()):
                hook(self, args, kwargs)
