"""Where 1-bit Adam averages its ranks' momenta, the one thing its two settings do apart.

On a fixed group (:class:`AtTheStep`) the DDP hook averages the warm-up's gradients exactly, then
sends only a finiteness flag; at ``optimizer.step()`` the ranks average their momenta, formed from
the gradients as they stand then (unscaled, clipped). Under a torchft ``Manager``
(:class:`InTheBackward`) ``should_commit()`` comes before ``optimizer.step()``, so the average runs
in the backward, where a failure can still un-commit the step, through a
:class:`~commpress.hooks.state.CommState` under the manager; a healing replica adds nothing to the
average (its optimizer state is stale until ``should_commit()``) and then applies the participants'.
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations.

import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from commpress.comm import Traffic, checkpoint
from commpress.comm.averager import ParameterAverager
from commpress.comm.pickling import BoundToProcess
from commpress.comm.warm import load_kernels
from commpress.compressors import AllReduce, Bucket, Reduction, lay_out
from commpress.config import Config, digest_of
from commpress.hooks.state import CommState
from commpress.local_sgd.average import check_finite

__all__ = ["AtTheStep", "InTheBackward", "MomentumAverage", "UnderManager"]


class Adam(Protocol):
    """What an average reads of its :class:`~commpress.optim.OneBitAdam`."""

    name: str
    named: list[tuple[str, torch.nn.Parameter]]
    params: list[torch.nn.Parameter]
    warmup_steps: int

    def local_momentum(self, p: torch.nn.Parameter, grad: torch.Tensor, out: torch.Tensor) -> None: ...


def _mean(tensor: torch.Tensor, world_size: int) -> Reduction:
    """Average ``tensor`` over ranks in place, exactly as DDP's own all-reduce does."""
    tensor.div_(world_size)
    summed = yield AllReduce(tensor)
    if summed is not tensor:
        tensor.copy_(summed)


def spread_non_finite(tensor: torch.Tensor, index: torch.Tensor | None = None) -> Reduction:
    """Make every rank's ``tensor`` (at ``index``, if given) NaN if any rank's is not finite, so a
    GradScaler skips the step everywhere while the gradients stay local."""
    local = tensor if index is None else tensor.index_select(0, index)
    flag = torch.zeros(1, dtype=torch.float32, device=tensor.device)
    if not bool(torch.isfinite(local).all()):
        flag.fill_(math.nan)
    summed = yield AllReduce(flag)
    if not bool(torch.isfinite(summed).all()):
        if index is None:
            tensor.fill_(math.nan)
        else:
            tensor.index_fill_(0, index, math.nan)


def written_grads(params: list[torch.nn.Parameter], name: str, step: int | None, noun: str, what: str) -> list[torch.Tensor]:
    """What the backward wrote into ``params``' gradients (each ``noun``'s ``what``), checked finite
    with one host sync for all: the largest magnitude of each (a NaN or an inf carries through)."""
    grads = [p.grad for p in params]
    if any(g is None for g in grads):
        raise RuntimeError(
            f"{name}: a {noun} has no gradient at step {step}; its {what} is its gradient here: do not clear or skip "
            "gradients between backward() and step()"
        )
    peaks = [torch.linalg.vector_norm(g, ord=math.inf) for g in grads if g.numel()]
    if peaks:
        check_finite(torch.stack(peaks), name, step or 0)
    return grads


class AtTheStep(BoundToProcess):
    """The momenta averaged by ``averager`` (any commpress method) as one flat float32 vector at
    ``optimizer.step()``; a step a GradScaler skips does not count."""

    adam: Adam

    def __init__(self, averager: ParameterAverager) -> None:
        self.averager = averager
        #: optimizer steps taken since registration (the warm-up ends at ``warmup_steps``)
        self.steps = 0
        self._check_resume = False

    def bind(self, adam: Adam) -> None:
        """Called once by ``adam``'s constructor: the flat layout of its parameters."""
        self.adam = adam
        self.slots, numel = lay_out((n, p.shape) for n, p in adam.named)
        self._flat = torch.empty(numel, dtype=torch.float32, device=adam.params[0].device)
        #: what every rank must share, and a checkpoint must have been saved with
        self.settings = {
            "algorithm": "onebit_adam",
            "warmup_steps": adam.warmup_steps,
            "averager": self.averager.method,
            "model": [[n, list(p.shape)] for n, p in adam.named],
        }

    @property
    def traffic(self) -> Traffic:
        return self.averager.traffic

    def connect(self, process_group: Any) -> None:
        """Agree on the settings across ranks (the one set-up exchange) and load the method's kernels
        now, before the freeze, in a simulated world (:mod:`commpress.comm.warm`)."""
        self.averager.connect(self.settings, self.adam.name, process_group)
        load_kernels(self.averager.groups, [(s.name, s.shape) for s in self.slots], self._flat.dtype, self._flat.device)

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The exact average during the warm-up; after it the local gradient, with the flag."""
        buffer = bucket.buffer()
        reduction = spread_non_finite(buffer) if self._frozen else _mean(buffer, self.averager.world_size)
        return self.averager.backend.run(reduction, buffer.device).then(lambda fut: (fut.value(), buffer)[1])

    def pending(self) -> int | None:
        """The step whose 1-bit update this ``optimizer.step()`` applies; None: AdamW's own step."""
        return self.steps if self._frozen else None

    @property
    def _frozen(self) -> bool:
        """Whether the warm-up is over: from then on the hook sends only the finiteness flag."""
        return self.steps >= self.adam.warmup_steps

    def start(self) -> torch.futures.Future:
        """Start averaging the local momenta (every rank in the same order); :meth:`finish` waits."""
        if self._check_resume and self.averager.can_block:
            checkpoint.check_resume(self.averager.backend, self.steps, digest_of(self.settings), self.adam.name)
        self._check_resume = False
        for slot, p in zip(self.slots, self.adam.params):
            if p.grad is None:
                raise RuntimeError(
                    f"{self.adam.name}: parameter {slot.name} has no gradient at step {self.steps}; every rank "
                    "averages every parameter's momentum (an unused parameter needs a zero gradient)"
                )
            self.adam.local_momentum(p, p.grad, out=self._flat[slot.offset : slot.offset + slot.numel].view(p.shape))
        return self.averager.start(Bucket(0, self._flat, self.slots))

    def finish(self, started: torch.futures.Future | None) -> list[torch.Tensor]:
        """Each parameter's averaged momentum, checked finite on every rank."""
        if started is not None:
            started.wait()
        check_finite(self._flat, self.adam.name, self.steps)
        return [self._flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    def stepped(self) -> None:
        self.steps += 1

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """The step counter and error feedback, tagged for this rank; ``full=True``: every rank's (a collective)."""
        backend = self.averager.backend
        part = checkpoint.tag(
            {"averager": self.averager.state_dict()}, backend.rank, backend.world_size, self.steps, self.settings
        )
        return checkpoint.gather_job(backend.allgather_object, part) if full else part

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's part, or its part of a whole-job state."""
        what = f"{self.adam.name}: load_state_dict"
        part = self.averager.own_part(state, what)
        checkpoint.check_config(part["config"], self.settings, what)
        self.steps = int(part["step"])
        self.averager.load_state_dict(part["averager"])
        self._check_resume = True


class UnderManager(BoundToProcess):
    """What a step takeover's backward setting under a torchft manager (1-bit Adam's, Dion's)
    reads of its :class:`CommState` ``comm``: the committed steps, the traffic, the state."""

    comm: CommState
    _step: int | None = None  # the step whose backward ran (1-bit Adam's: if it was past the warm-up)

    @property
    def steps(self) -> int:
        return self.comm.steps

    @property
    def traffic(self) -> Traffic:
        return self.comm.traffic

    def stepped(self) -> None:
        self._step = None

    def state_dict(self, full: bool = False, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The hook's step and error feedback (Dion's: each replica's momenta and the shared Q, the rest's);
        the manager recovers the optimizer's state with the model."""
        return self.comm.state_dict(full=full)

    def load_state_dict(self, state: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> None:
        self.comm.load_state_dict(state)


class InTheBackward(UnderManager):
    """The momenta averaged per DDP bucket by ``comm`` (a :class:`CommState` under
    ``manager`` whose ``start_iter`` is the warm-up); ``steps`` counts the committed steps."""

    adam: Adam

    def __init__(self, comm: CommState, manager: Any) -> None:
        self.comm = comm
        self.manager = manager

    @classmethod
    def of(
        cls,
        module: torch.nn.Module,
        manager: Any,
        method: str,
        params: Mapping[str, Any],
        warmup_steps: int,
        key: str = "commpress_onebit_adam",
    ) -> "InTheBackward":
        """``method`` over ``manager`` for ``module``'s buckets, exact for ``warmup_steps``, its state under ``key``."""
        config = Config(method=method, params=dict(params), start_iter=warmup_steps)
        return cls(CommState.of_part(config, module, manager=manager, key=key), manager)

    def bind(self, adam: Adam) -> None:
        self.adam = adam

    def connect(self, process_group: Any) -> None:
        """Nothing: the state connected through the manager when it was built."""

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket's average through the manager: past the warm-up, of this replica's momentum."""
        buffer, params = bucket.buffer(), bucket.parameters()
        self.manager.wait_quorum()
        step = self.comm.steps
        self._step = step if step >= self.adam.warmup_steps else None
        if self._step is not None and self.manager.is_participating():
            offset = 0
            for p in params:
                grad = buffer[offset : offset + p.numel()].view(p.shape)
                self.adam.local_momentum(p, grad, out=grad)
                offset += p.numel()
        return self.comm.reduce(bucket.index(), buffer, params, advance=bucket.is_last())

    def pending(self) -> int | None:
        return self._step

    def start(self) -> None:
        """Nothing: the backward averaged the momenta."""

    def finish(self, started: None) -> list[torch.Tensor]:
        """The averaged momenta DDP wrote into the gradients."""
        return written_grads(self.adam.params, self.adam.name, self._step, "parameter", "averaged momentum")


#: where a :class:`~commpress.optim.OneBitAdam` averages its momenta
MomentumAverage = AtTheStep | InTheBackward
