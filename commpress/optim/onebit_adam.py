"""1-bit Adam (Tang et al., 2021) on the user's own ``torch.optim.AdamW``: exact AdamW for a
warm-up, then the second moment frozen and the first moment averaged compressed.

During the warm-up the DDP hook averages gradients exactly (as DDP does) and AdamW steps
unchanged, so the run is plain DDP + AdamW bit for bit. From step ``warmup_steps`` on,
gradients stay local (the hook sends one finiteness flag per bucket) and, at each
``optimizer.step()``, every rank forms its local momentum ``beta1 * m + (1 - beta1) * g``,
the ranks average it through any commpress method (``onebit`` by default, with its error
feedback) and every rank applies AdamW's update with that average and the frozen variance::

    m     = average over ranks of (beta1 * m + (1 - beta1) * g_rank)
    m_hat = m / (1 - beta1**t)
    p     = p * (1 - lr * weight_decay)
    p     = p - lr * m_hat / (max(sqrt(v_T / (1 - beta2**T)), |m_hat|) + eps)

``T`` is the step at which ``v`` froze, so ``v_T / (1 - beta2**T)`` is AdamW's own
bias-corrected variance at the freeze; ``t`` keeps counting, as AdamW's bias correction of
the momentum does. The ``max`` keeps every coordinate's step within ``lr``, Adam's own
bound: a coordinate whose gradient grew after the freeze (an embedding row first seen
later has ``v_T = 0``) would otherwise take a step of ``lr * m_hat / eps`` and diverge, as
the quality suite's charlm task does at a freeze after 15% of its steps.

``m`` and ``v`` stay in the optimizer's state (``exp_avg``, ``exp_avg_sq``, ``step``), so
the optimizer's own ``state_dict`` saves them; this object's :meth:`state_dict` adds
the step counter and the compressor's error feedback.

Why a hand-over rather than a new optimizer class: the user keeps the AdamW they built,
its param groups, LR scheduler and checkpoint, and the warm-up *is* that AdamW. After the
freeze, the step pre-hook applies the update and hides the gradients from AdamW's own
step (which then skips every parameter); the post-hook gives them back.
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations.

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from commpress.comm import Traffic, checkpoint
from commpress.comm.averager import ParameterAverager
from commpress.comm.pickling import BoundToProcess
from commpress.comm.warm import load_kernels
from commpress.compressors import AllReduce, Bucket, Reduction, lay_out
from commpress.config import digest_of
from commpress.errors import ConfigError
from commpress.hooks.removable import CommHookSwitch, register_removable_hook
from commpress.local_sgd.average import check_finite

__all__ = ["AdamStepTakeover", "OneBitAdam", "adam_parameters", "check_adam", "frozen_update"]

_WHERE = "[onebit_adam]"


def check_adam(optimizer: Any) -> None:
    """Refuse, naming it, an optimizer or option whose step 1-bit Adam does not reproduce:
    it takes ``torch.optim.AdamW``, or ``torch.optim.Adam`` with ``weight_decay = 0`` or
    ``decoupled_weight_decay = True``, without amsgrad, maximize, capturable or
    differentiable, on real floating-point parameters."""
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
    """The trainable ``named_parameters``, checked: the optimizer holds every one and all
    are float32 (the momentum is averaged as float32)."""
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


def check_warmup(warmup_steps: Any) -> None:
    """Refuse a warm-up that is not an integer >= 0."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError(f"{_WHERE}: warmup_steps = {warmup_steps!r} is not accepted; expected an integer >= 0")


def adam_state(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter, warmup_steps: int, what: str) -> dict[str, Any]:
    """``optimizer``'s Adam state of ``p``, which must hold the variance measured in the warm-up."""
    state = optimizer.state[p]
    if "exp_avg_sq" not in state:
        raise RuntimeError(
            f"{what}: the optimizer holds no Adam state for a parameter at the freeze (warmup_steps = "
            f"{warmup_steps}): the variance must have been measured; use warmup_steps >= 1"
        )
    return state


@torch.no_grad()
def frozen_update(
    group: Mapping[str, Any], state: dict[str, Any], p: torch.nn.Parameter, momentum: torch.Tensor, frozen_steps: int
) -> None:
    """AdamW's step of ``p`` (its param ``group`` and Adam ``state``) with the averaged
    ``momentum`` and the variance frozen ``frozen_steps`` steps ago (see the module's formula)."""
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


def _mean(tensor: torch.Tensor, world_size: int) -> Reduction:
    """Average ``tensor`` over ranks in place, exactly as DDP's own all-reduce does."""
    tensor.div_(world_size)
    summed = yield AllReduce(tensor)
    if summed is not tensor:
        tensor.copy_(summed)


def _spread_non_finite(tensor: torch.Tensor) -> Reduction:
    """Every rank's ``tensor`` becomes NaN if any rank's holds inf or NaN, so a GradScaler
    skips the step on every rank (gradients stay local after the freeze)."""
    flag = torch.zeros(1, dtype=torch.float32, device=tensor.device)
    if not bool(torch.isfinite(tensor).all()):
        flag.fill_(math.nan)
    summed = yield AllReduce(flag)
    if not bool(torch.isfinite(summed).all()):
        tensor.fill_(math.nan)


def comm_hook(state: "OneBitAdam", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook of 1-bit Adam: the exact average during the warm-up, after it the
    local gradient (with the finiteness flag)."""
    buffer = bucket.buffer()
    reduction = _spread_non_finite(buffer) if state.frozen else _mean(buffer, state.averager.world_size)
    return state.averager.backend.run(reduction, buffer.device).then(lambda fut: (fut.value(), buffer)[1])


class AdamStepTakeover(BoundToProcess):
    """AdamW's step taken over through its step hooks, as both 1-bit Adams do: the DDP comm
    hook and the optimizer's hooks go on at :meth:`_attach` and off at :meth:`detach`; the
    pre-hook runs :meth:`_take_step` and, where that applied the update, hides the gradients
    so AdamW's own step skips every parameter; the post-hook gives them back, then
    :meth:`_stepped`. Subclasses set ``optimizer`` and ``params``."""

    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    _hooks: tuple[RemovableHandle, ...] = ()
    _switch: CommHookSwitch | None = None
    _hidden: tuple[tuple[torch.nn.Parameter, torch.Tensor | None], ...] = ()  # during AdamW's step

    def _attach(self, model: DistributedDataParallel, hook: Any) -> None:
        self._switch = register_removable_hook(model, self, hook)
        self._hooks = (
            self.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._pre_step()),
            self.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self._post_step()),
        )

    def detach(self) -> None:
        """Take off what :meth:`attach` registered: DDP all-reduces gradients again and
        ``optimizer.step()`` is AdamW's own step."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = ()
        if self._switch is not None:
            self._switch.remove()

    def _take_step(self) -> bool:
        """Apply this step's update, if it is this object's; whether it did."""
        raise NotImplementedError

    def _stepped(self) -> None:
        """After the optimizer's step."""

    def _pre_step(self) -> None:
        if not self._take_step():
            return
        self._hidden = tuple((p, p.grad) for p in self.params)
        for p in self.params:
            p.grad = None  # AdamW's own step skips every parameter: this step is done

    def _post_step(self) -> None:
        for p, grad in self._hidden:
            p.grad = grad
        self._hidden = ()
        self._stepped()


class OneBitAdam(AdamStepTakeover):
    """1-bit Adam attached to ``optimizer`` (``torch.optim.AdamW``) for the parameters
    ``named_parameters``; the momentum is averaged by ``averager`` (any commpress method)
    after ``warmup_steps`` exact steps. :meth:`attach` registers the DDP comm hook and the
    optimizer's step hooks (what :func:`commpress.register` does with an ``[onebit_adam]``
    table); then the loop stays ``loss.backward(); optimizer.step()``.

    ``steps`` counts the optimizer steps taken since registration (a step a GradScaler
    skips is not taken). A non-finite momentum average raises ``FloatingPointError`` on
    every rank and changes nothing.
    """

    name = "1-bit Adam"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        averager: ParameterAverager,
        warmup_steps: int,
    ) -> None:
        check_adam(optimizer)
        check_warmup(warmup_steps)
        named = adam_parameters(optimizer, named_parameters)
        self.optimizer = optimizer
        self.averager = averager
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.params = [p for _, p in named]
        self.slots, numel = lay_out((n, p.shape) for n, p in named)
        self._flat = torch.empty(numel, dtype=torch.float32, device=self.params[0].device)
        self._group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        #: what every rank must share, and a checkpoint must have been saved with
        self.settings = {
            "algorithm": "onebit_adam",
            "warmup_steps": warmup_steps,
            "averager": averager.method,
            "model": [[n, list(p.shape)] for n, p in named],
        }
        self._check_resume = False
        self.wait_seconds: list[float] = []

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen: the next step averages the momentum."""
        return self.steps >= self.warmup_steps

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent: the warm-up's gradients, the flags and the momentum."""
        return self.averager.traffic

    def attach(self, model: DistributedDataParallel, process_group: Any = None) -> None:
        """Register the DDP comm hook on ``model`` (before its first backward) and the
        optimizer's step hooks; the ranks first agree on the settings. The averaging
        method's kernels are loaded here (:meth:`load_kernels`), not at the freeze."""
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"{_WHERE} runs under DistributedDataParallel; got {type(model).__name__}")
        self.averager.connect(self.settings, self.name, process_group)  # the one set-up exchange
        self.load_kernels()
        self._attach(model, comm_hook)

    def load_kernels(self) -> None:
        """Run the momentum's averaging method once on values shaped like the momentum's
        tensors, by fresh compressors in a simulated world (:mod:`commpress.comm.warm`):
        its kernels are compiled or loaded now, not at the first step after the freeze;
        nothing is sent and no state changes."""
        load_kernels(self.averager.groups, [(s.name, s.shape) for s in self.slots], self._flat.dtype, self._flat.device)

    def _take_step(self) -> bool:
        """After the freeze: the momentum averaged and AdamW's update with it."""
        if not self.frozen:
            return False
        if self._check_resume and self.averager.can_block:
            checkpoint.check_resume(self.averager.backend, self.steps, digest_of(self.settings), self.name)
        self._check_resume = False
        self.finish_step(self.start_step())
        return True

    def _stepped(self) -> None:
        self.steps += 1

    def start_step(self) -> torch.futures.Future:
        """Start averaging the local momenta ``beta1 * m + (1 - beta1) * grad`` (after the
        freeze; every rank calls it in the same order). :meth:`finish_step` applies it."""
        for slot, p in zip(self.slots, self.params):
            if p.grad is None:
                raise RuntimeError(
                    f"{self.name}: parameter {slot.name} has no gradient at step {self.steps}; every rank averages "
                    "every parameter's momentum (an unused parameter needs a zero gradient)"
                )
            beta1 = self._group_of[id(p)]["betas"][0]
            local = self._flat[slot.offset : slot.offset + slot.numel].view(p.shape)
            local.copy_(self._state(p)["exp_avg"]).lerp_(p.grad, 1 - beta1)
        return self.averager.start(Bucket(0, self._flat, self.slots))

    @torch.no_grad()
    def finish_step(self, started: torch.futures.Future) -> None:
        """Wait for the momentum average and apply AdamW's update with the frozen variance."""
        t0 = time.perf_counter()
        started.wait()
        self.wait_seconds.append(time.perf_counter() - t0)
        check_finite(self._flat, self.name, self.steps)
        frozen_steps = self.steps - self.warmup_steps
        for slot, p in zip(self.slots, self.params):
            momentum = self._flat[slot.offset : slot.offset + slot.numel].view(p.shape)
            frozen_update(self._group_of[id(p)], self._state(p), p, momentum, frozen_steps)

    def _state(self, p: torch.nn.Parameter) -> dict[str, Any]:
        return adam_state(self.optimizer, p, self.warmup_steps, self.name)

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """The step counter and the compressor's state (error feedback), tagged with this
        rank, the world size and the settings; ``full=True``: every rank's (a collective).
        The momentum and the frozen variance are the optimizer's state: save it as usual."""
        backend = self.averager.backend
        part = checkpoint.tag(
            {"averager": self.averager.state_dict()}, backend.rank, backend.world_size, self.steps, self.settings
        )
        return checkpoint.gather_job(backend.allgather_object, part) if full else part

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's part, or its part of a whole-job state."""
        what = f"{self.name}: load_state_dict"
        part = self.averager.own_part(state, what)
        checkpoint.check_config(part["config"], self.settings, what)
        self.steps = int(part["step"])
        self.averager.load_state_dict(part["averager"])
        self._check_resume = True
