"""1-bit Adam (Tang et al., 2021) on the user's own ``torch.optim.AdamW``: exact AdamW for a
warm-up, then the second moment frozen and the first moment averaged compressed.

The warm-up is plain DDP + AdamW, bit for bit. From step ``warmup_steps`` on, the ranks average
their local momenta through any commpress method (``onebit`` by default; where it runs:
:mod:`commpress.optim.momentum`) and apply AdamW's update with it and the frozen variance::

    m     = average over ranks of (beta1 * m + (1 - beta1) * g_rank)
    m_hat = m / (1 - beta1**t)
    p     = p * (1 - lr * weight_decay)
    p     = p - lr * m_hat / (max(sqrt(v_T / (1 - beta2**T)), |m_hat|) + eps)

``T`` is the step at which ``v`` froze; ``t`` keeps counting. The ``max`` keeps each step within
``lr``, Adam's own bound, where a gradient grew after the freeze (an embedding row first seen later
has ``v_T = 0`` and would step ``lr * m_hat / eps``). AdamW's step is taken over through its step
hooks (:mod:`commpress.optim.takeover`), not a new optimizer class, so the user keeps their AdamW,
its scheduler and checkpoint (which saves ``m`` and ``v``), and the warm-up *is* that AdamW.
"""

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from commpress.comm import Traffic
from commpress.errors import ConfigError
from commpress.optim.hybrid import HybridOptimizer, describe
from commpress.optim.momentum import MomentumAverage
from commpress.optim.takeover import StepTakeover

__all__ = ["OneBitAdam", "adam_parameters", "check_adam", "frozen_update"]

_WHERE = "[onebit_adam]"


def check_adam(optimizer: Any) -> None:
    """Refuse an optimizer or option whose step 1-bit Adam does not reproduce: it takes AdamW, or
    Adam without L2 weight decay, on real floats, without amsgrad, maximize, capturable, differentiable."""
    if isinstance(optimizer, HybridOptimizer):
        raise ConfigError(
            f"{_WHERE} takes over the step of one torch.optim.AdamW over every parameter; got a HybridOptimizer of "
            + "; ".join(describe(o) for o in optimizer.optimizers)
            + ": pass one AdamW, or with Muon use a method that leaves the step to the optimizers"
        )
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        raise ConfigError(
            f"{_WHERE} takes over the step of torch.optim.AdamW (or Adam); got {type(optimizer).__name__}: "
            "use AdamW, or another method for this optimizer"
        )
    for i, group in enumerate(optimizer.param_groups):
        for option in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(option):
                raise ConfigError(f"{_WHERE}: param group {i} sets {option} = True, which 1-bit Adam does not take")
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
        if group["weight_decay"] and not decoupled:
            raise ConfigError(
                f"{_WHERE}: param group {i} has Adam's L2 weight_decay = {group['weight_decay']}; 1-bit Adam applies "
                "AdamW's decoupled weight decay: use torch.optim.AdamW, or Adam(decoupled_weight_decay=True)"
            )
        for p in group["params"]:
            if p.is_complex() or not p.is_floating_point():
                raise ConfigError(f"{_WHERE}: param group {i} holds a {p.dtype} parameter; 1-bit Adam takes real floats")


def adam_parameters(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]
) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable ``named_parameters``, checked: all held by the optimizer, all float32 like the momentum."""
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for n, p in named if id(p) not in owned]
    if missing:
        raise ConfigError(f"{_WHERE}: the optimizer does not hold parameters {', '.join(missing[:3])}: give it every parameter")
    dtypes = {p.dtype for _, p in named}
    if dtypes != {torch.float32}:
        found = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise ConfigError(f"{_WHERE}: the momentum is averaged as one float32 vector; the parameters are {found}")
    return named


@torch.no_grad()
def frozen_update(
    group: Mapping[str, Any], state: dict[str, Any], p: torch.nn.Parameter, momentum: torch.Tensor, frozen_steps: int
) -> None:
    """AdamW's step of ``p`` with the averaged ``momentum`` and the variance frozen ``frozen_steps`` ago."""
    beta1, beta2 = group["betas"]
    lr, eps = float(group["lr"]), group["eps"]
    state["exp_avg"].copy_(momentum)
    state["step"] += 1
    t = int(state["step"])
    freeze = t - 1 - frozen_steps  # the step at which v froze
    p.mul_(1 - lr * group["weight_decay"])
    m_hat = state["exp_avg"] / (1 - beta1**t)
    denom = torch.maximum(state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**freeze), m_hat.abs()).add_(eps)
    p.addcdiv_(m_hat, denom, value=-lr)


class OneBitAdam(StepTakeover):
    """1-bit Adam on ``optimizer`` for ``named_parameters``: ``warmup_steps`` exact steps, then the
    momenta averaged by ``average`` (:class:`AtTheStep` or :class:`InTheBackward`). :meth:`attach`
    hooks it in, as :func:`commpress.register` does for ``[onebit_adam]``; a non-finite momentum
    average raises ``FloatingPointError`` on every rank and changes nothing."""

    name = "1-bit Adam"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        average: MomentumAverage,
        warmup_steps: int,
    ) -> None:
        check_adam(optimizer)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"{_WHERE}: warmup_steps = {warmup_steps!r} is not accepted; expected an integer >= 0")
        self.named = adam_parameters(optimizer, named_parameters)
        self.params = [p for _, p in self.named]
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self._group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        self.average = average
        average.bind(self)

    @property
    def steps(self) -> int:
        """Optimizer steps taken since registration (under a manager: the committed ones)."""
        return self.average.steps

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen: the next step averages the momentum."""
        return self.steps >= self.warmup_steps

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent: the warm-up's gradients, the flags and the momenta."""
        return self.average.traffic

    def attach(self, model: DistributedDataParallel, process_group: Any = None) -> None:
        """Once the ranks agree, register the DDP comm hook (before the first backward) and step hooks."""
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"{_WHERE} runs under DistributedDataParallel; got {type(model).__name__}")
        self.average.connect(process_group)
        self._take_over(model, self.optimizer, self.average)

    def local_momentum(self, p: torch.nn.Parameter, grad: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's ``beta1 * m + (1 - beta1) * grad`` of ``p`` into ``out`` (which may be ``grad``)."""
        beta1 = self._group_of[id(p)]["betas"][0]
        torch.lerp(self._state(p)["exp_avg"], grad, 1 - beta1, out=out)

    def _pre_step(self) -> None:
        """After the freeze: the momenta averaged and AdamW's update with them."""
        if self.average.pending() is None:
            return
        self.finish_step(self.start_step())
        self._hide_grads(self.params)

    def start_step(self) -> torch.futures.Future | None:
        """Start this step's momentum average (every rank in the same order); :meth:`finish_step` applies it."""
        return self.average.start()

    @torch.no_grad()
    def finish_step(self, started: torch.futures.Future | None) -> None:
        """Wait for the momentum average and apply AdamW's update with the frozen variance."""
        step = self.average.pending()
        if step is None:
            raise RuntimeError(f"{self.name}: finish_step before the freeze (step {self.steps})")
        frozen_steps = step - self.warmup_steps
        for p, momentum in zip(self.params, self.average.finish(started)):
            frozen_update(self._group_of[id(p)], self._state(p), p, momentum, frozen_steps)

    def _state(self, p: torch.nn.Parameter) -> dict[str, Any]:
        """The optimizer's Adam state of ``p``, which must hold the variance measured in the warm-up."""
        state = self.optimizer.state[p]
        if "exp_avg_sq" not in state:
            raise RuntimeError(
                f"{self.name}: the optimizer holds no Adam state for a parameter at the freeze (warmup_steps = "
                f"{self.warmup_steps}): the variance must have been measured; use warmup_steps >= 1"
            )
        return state

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """The average's step counter and error feedback (``full=True``: every rank's, a collective); the
        momentum and frozen variance are the optimizer's state, saved as usual."""
        return self.average.state_dict(full=full)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's part, or its part of a whole-job state."""
        self.average.load_state_dict(state)
