"""Local SGD: every rank takes optimizer steps on its own, and the ranks average their
models when the period policy says so (a constant H, or QSR).

At the end of a round the pseudo-gradient ``anchor - local`` is averaged over ranks and
the outer optimizer, a ``torch.optim.Optimizer`` over the anchor, steps the anchor with
it; the local model then takes the new anchor. Local SGD's outer optimizer is SGD at lr 1
without momentum: the anchor becomes the average. :class:`~commpress.local_sgd.CO2` and
:class:`~commpress.local_sgd.DiLoCo` change when the average lands and which outer
optimizer steps it."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from commpress.comm import Traffic, checkpoint
from commpress.comm.averager import ParameterAverager
from commpress.comm.pickling import BoundToProcess
from commpress.compressors import host
from commpress.compressors.registry import methods_taking
from commpress.config import digest_of
from commpress.config.tables import LocalSGDConfig
from commpress.errors import ConfigError
from commpress.local_sgd.ddp import skip_gradient_allreduce
from commpress.local_sgd.flat import FlatModel
from commpress.local_sgd.periods import Period
from commpress.local_sgd.rounds import RoundClock

__all__ = ["Average", "LocalSGD", "OuterOptimizer", "check_finite", "check_outer_arguments", "describe_optimizer"]

#: Builds the outer optimizer over the anchor's tensors (one flat tensor, or one per
#: DiLoCo fragment), e.g. ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``.
OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
#: a rank's vote on an average (the shards' minimum wins): not finite, failed, fine
_NON_FINITE, _FAILED, _FINE = 0, 1, 2


def check_finite(average: torch.Tensor, name: str, round_index: int, shard_group: Any = None, failed: bool = False) -> None:
    """Refuse a non-finite average before it reaches the anchor (or CO2's momentum): every
    rank holds the same average, so every rank raises, and the state stays as it was. A
    sharded model's ranks (``shard_group``, the ranks holding the other shards) agree first,
    so a shard's inf stops its whole group, not its own rank alone. A rank whose average
    ``failed`` (its collective raised: a lost replica under a torchft Manager) votes too,
    so its shards' ranks never wait for it: they raise a RuntimeError, and the caller
    re-raises the failure; an inf anywhere outranks a failure."""
    status = _FAILED if failed else (_FINE if host.flags(host.finite(average))[0] else _NON_FINITE)
    if shard_group is not None:
        flag = torch.tensor([status], dtype=torch.int32, device=average.device)  # NCCL takes CUDA tensors only
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=shard_group)
        status = int(flag.item())
    if status == _NON_FINITE:
        raise FloatingPointError(
            f"{name}: the average of round {round_index} is not finite (a rank's model holds inf or NaN); "
            "the anchor and the outer state were left unchanged: restore a checkpoint or lower the learning rate"
        )
    if status == _FAILED and not failed:
        raise RuntimeError(f"{name}: the average of round {round_index} failed on a rank holding another shard of the model")


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A user's outer optimizer as settings the ranks compare: its class and defaults."""
    kind = type(optimizer)
    return {"class": f"{kind.__module__}.{kind.__qualname__}", **{k: v for k, v in optimizer.defaults.items() if k != "params"}}


def check_outer_arguments(name: str, outer_optimizer: OuterOptimizer | None, built_in: Mapping[str, Any]) -> None:
    """Refuse the arguments of the built-in outer SGD (``built_in``, None where unset)
    next to a given ``outer_optimizer``: its own arguments set those."""
    given = [key for key, value in built_in.items() if value is not None]
    if outer_optimizer is not None and given:
        raise ConfigError(
            f"{name}: {', '.join(given)} = {', '.join(repr(built_in[k]) for k in given)} is not accepted with "
            "outer_optimizer; expected None (set them in the optimizer outer_optimizer builds)"
        )


@dataclass
class Average:
    """A pseudo-gradient being averaged over ranks, in place in ``buffer``, started in
    round ``round``."""

    future: torch.futures.Future
    buffer: torch.Tensor
    round: int


class LocalSGD(BoundToProcess):
    """Call :meth:`step` in place of ``optimizer.step()``; it averages the model across
    ranks at the end of every round. Or call :meth:`register_optimizer_hooks` once and keep
    calling ``optimizer.step()`` (what :func:`commpress.register` does).

    ``period``: an int (average every ``period`` steps) or a :class:`Period` such as
    :class:`QSR` (None: the ``[local_sgd]`` table's default). ``averager``: a
    :class:`~commpress.comm.averager.ParameterAverager`, or a compressor name (``"none"``,
    ``"bf16"``, ...) for the averaging all-reduce. ``average_buffers`` also averages
    floating-point buffers (BatchNorm statistics). ``total_steps`` lets QSR cap the last
    round at the last step.

    ``wait_seconds`` records how long each averaging blocked the caller. A non-finite
    average raises ``FloatingPointError`` on every rank and changes nothing.

    With DDP, a comm hook that keeps gradients local is registered here (construct before
    the first backward); a plain module gets rank 0's values at construction. The optimizer
    state (momenta, Adam moments) stays local: only the model is averaged. The ranks agree
    on the settings in one exchange at construction.

    With an averager whose backend cannot block (ranks of a
    :class:`commpress.comm.SimulatedWorld`, all in one thread) the set-up agreement and
    broadcast are left out: build every rank's trainer from one config and identical
    models. Such ranks take their steps one after another through :meth:`local_step`
    (every rank) and then :meth:`apply_due` (every rank); :meth:`finish` likewise as
    ``start_due(final=True)``, then ``apply_due(final=True)``.
    """

    name = "local SGD"
    #: the ``[local_sgd]`` table's algorithm, whose defaults fill the arguments left None
    algorithm = "local_sgd"
    #: whether the compressor's state changes commit when an average lands (False: the
    #: trainer settles them itself, as under a torchft Manager)
    commits_when_averaged = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        period: int | Period | None = None,
        process_group: Any = None,
        averager: ParameterAverager | str | None = None,
        average_buffers: bool = False,
        total_steps: int | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        period = self._round_period(self.default("period") if period is None else period)
        self.clock = RoundClock(period, total_steps, self.name)
        is_ddp = isinstance(model, DistributedDataParallel)
        if process_group is None and is_ddp:
            process_group = model.process_group
        if not isinstance(averager, ParameterAverager):
            averager = ParameterAverager(averager or "none", process_group=process_group)
        self.averager = averager
        self.flat = FlatModel(model, buffers=average_buffers)
        #: the last average, identical on every rank; rounds average differences from it
        self.anchor = self.flat.read()
        #: what the outer optimizer steps: views of the anchor
        self.outer_params = self._outer_params()
        self.outer_optimizer = self._outer_optimizer(self.outer_params)
        #: what every rank must share, and a checkpoint must have been saved with
        self.settings = {"algorithm": self.name, "period": repr(period), "averager": self.averager.method, **self._settings()}
        self.settings["model"] = [[n, list(p.shape)] for n, p in model.named_parameters()]
        if self.flat.shard_group is not None:  # a shard of the model: a checkpoint holds this shard's rows
            self.settings["shard_shapes"] = [list(s.shape) for s in self.flat.slots]
        self.averager.connect(self.settings, self.name, process_group)  # the one set-up exchange
        self._check_resume = False  # after a load: ranks compare step and settings at the next averaging
        compressor = self.averager.compressor
        if self.flat.dtype not in compressor.dtypes:
            dtype = str(self.flat.dtype).removeprefix("torch.")
            takers = methods_taking(self.flat.dtype)
            advice = f"average with {' / '.join(takers)}, or convert the model" if takers else "convert the model"
            raise ConfigError(
                f"{self.name} averages the model's {dtype} values with method {compressor.name!r}, which does not "
                f"take {dtype}: {advice}"
            )
        #: what keeps DDP's gradients local (None for a plain module)
        self.ddp_switch = skip_gradient_allreduce(model) if is_ddp else None  # DDP broadcast rank 0's model
        fixed = self.averager.backend.fixed_members  # under a torchft Manager a replica heals from a peer instead
        if not is_ddp and self.averager.can_block and fixed:  # ranks in one thread start from identical models (class docstring)
            self.averager.broadcast(self.anchor)
            self.flat.write(self.anchor)
        self._average: Average | None = None
        self.wait_seconds: list[float] = []
        self._hooks: list[RemovableHandle] = []

    @classmethod
    def default(cls, key: str) -> Any:
        """``key``'s default for this algorithm: the ``[local_sgd]`` table's, the one source."""
        return LocalSGDConfig(algorithm=cls.algorithm).value(key)  # type: ignore[arg-type]

    def _round_period(self, period: int | Period) -> int | Period:
        """The period of a round (DiLoCo's streaming syncs a fragment per round)."""
        return period

    def _outer_params(self) -> list[torch.Tensor]:
        """The tensors the outer optimizer steps: the whole anchor."""
        return [self.anchor]

    def _outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """Plain averaging: SGD at lr 1 without momentum, the anchor becomes the average."""
        return torch.optim.SGD(params, lr=1.0)

    def _settings(self) -> dict[str, Any]:
        """Settings every rank must share, beyond the period and the averaging method."""
        return {}

    @property
    def period(self) -> int | None:
        """H of the current round (None between an averaging and the next step)."""
        return self.clock.period

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent for averaging."""
        return self.averager.traffic

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One local optimizer step; averages when it ends the round."""
        if self._hooks:
            raise RuntimeError(
                f"{self.name} runs from the optimizer's step hooks (register_optimizer_hooks, commpress.register): "
                "call optimizer.step(), not step(), or every step would count twice"
            )
        loss = self.local_step(closure)
        self.apply_due()
        return loss

    def local_step(self, closure: Callable[[], float] | None = None) -> Any:
        """:meth:`step` up to the averages it starts, without landing those due: ranks run
        one after another in one thread (a :class:`commpress.comm.SimulatedWorld`) call
        ``local_step`` on every rank, then :meth:`apply_due` on every rank."""
        self._begin_step()
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.clock.end_step()
        self.start_due()
        return loss

    def register_optimizer_hooks(self) -> None:
        """Run the rounds from ``optimizer.step()`` itself, through its step pre- and
        post-hooks (as torchft runs DiLoCo), so the training loop keeps calling
        ``optimizer.step()``. A step the optimizer does not take (GradScaler skips it on
        inf) is not counted. :meth:`step` is refused from then on."""
        if not self._hooks:
            self._hooks = [
                self.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._begin_step()),
                self.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self._end_step()),
            ]

    def remove_hooks(self) -> None:
        """Take this trainer's hooks off the optimizer and the DDP model: ``optimizer.step()``
        is a plain step again and DDP all-reduces gradients (call :meth:`finish` first for
        one model on every rank)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.ddp_switch is not None:
            self.ddp_switch.remove()

    def _begin_step(self) -> None:
        self.clock.begin_step(float(self.optimizer.param_groups[0]["lr"]))

    def _end_step(self) -> None:
        self.clock.end_step()
        self.start_due()
        self.apply_due()

    def _check_ranks(self) -> None:
        """After a load, the ranks compare step and settings at the first sync."""
        if self._check_resume and self.averager.can_block:
            checkpoint.check_resume(self.averager.backend, self.clock.step, digest_of(self.settings), self.name)
        self._check_resume = False

    def start_due(self, final: bool = False) -> None:
        """At the end of a round (``final``: of a round in progress), start averaging the
        pseudo-gradient of the whole model."""
        if not (self.clock.in_round if final else self.clock.round_ends):
            return
        self._check_ranks()
        self._average = self._start(self.anchor, self.flat.read(), self.flat.bucket)

    def apply_due(self, final: bool = False) -> None:
        """Land the average started at this step: the outer step, then the local model
        takes the anchor; then end the round. A failed average (a peer lost, a non-finite
        value) raises before the round is counted."""
        if self._average is not None:
            average, self._average = self._average, None
            self.outer_step(0, self._wait(average))
            self.flat.write(self.anchor)
        self._end_round(final)

    def _end_round(self, final: bool) -> None:
        """Count the round if this step ended it (``final``: if steps were taken in it)."""
        if self.clock.round_ends or (final and self.clock.in_round):
            self.clock.round_done()

    def _start(self, anchor: torch.Tensor, local: torch.Tensor, bucket: Callable[[torch.Tensor], Any]) -> Average:
        """Start averaging ``anchor - local`` (computed into ``local``), as ``bucket`` wraps it."""
        torch.sub(anchor, local, out=local)
        return Average(self.averager.start(bucket(local), self.commits_when_averaged), local, self.clock.rounds)

    def _wait(self, average: Average) -> torch.Tensor:
        """The averaged pseudo-gradient, once it is there and finite (the wait recorded)."""
        t0 = time.perf_counter()
        failure = None
        try:
            average.future.wait()
        except Exception as exc:  # a sharded model's ranks vote first (check_finite), then it is raised
            if self.flat.shard_group is None:
                raise
            failure = exc
        self.wait_seconds.append(time.perf_counter() - t0)
        check_finite(average.buffer, self.name, average.round, self.flat.shard_group, failed=failure is not None)
        if failure is not None:
            raise failure
        return average.buffer

    def outer_step(self, index: int, average: torch.Tensor) -> None:
        """The outer optimizer's step of ``outer_params[index]`` with the averaged
        pseudo-gradient ``average`` as its gradient; the other tensors have none."""
        param = self.outer_params[index]
        param.grad = average
        try:
            self.outer_optimizer.step()
        finally:
            param.grad = None

    def finish(self) -> None:
        """End of training: average the steps taken since the last round (CO2: apply the
        last average; DiLoCo: land what is in flight and sync every fragment changed since),
        so every rank ends with the same model."""
        self.start_due(final=True)
        self.apply_due(final=True)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """The model at its last sync (the anchor: the same on every rank) in place of this
        rank's own parameters for the block, which are put back after it: evaluate or save
        the job's model mid-run, on any rank, without a sync or a collective."""
        own = self.flat.read()
        self.flat.write(self.anchor)
        try:
            yield
        finally:
            self.flat.write(own)

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """Step and round counters, H, the anchor, the outer optimizer's state (DiLoCo:
        the fragments' state and averages in flight), and the averager's state (save the model and the
        optimizer alongside, as usual), tagged with this rank, the world size
        and the settings; ``full=True``: every rank's (a collective; see
        :meth:`commpress.CommState.state_dict`)."""
        backend = self.averager.backend
        if full and self.flat.shard_group is not None:
            raise ValueError(
                f"{self.name}: state_dict(full=True) gathers the ranks holding this rank's shard only, not the other "
                "shards: save every rank's state_dict() (torch.save on every rank, or torch.distributed.checkpoint "
                "with Registration.stateful(model, optimizer))"
            )
        part = checkpoint.tag(self._part(), backend.rank, backend.world_size, self.clock.step, self.settings)
        return checkpoint.gather_job(backend.allgather_object, part) if full else part

    def _part(self) -> dict[str, Any]:
        """Counters, anchor, the outer optimizer's state and the averager's state."""
        if self._average is not None:
            raise RuntimeError(f"{self.name}: state_dict() between local_step() and apply_due(): land the average first")
        return {
            "clock": self.clock.state_dict(),
            "anchor": self.anchor.clone(),
            "outer": copy.deepcopy(self.outer_optimizer.state_dict()),
            "averager": self.averager.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's part, or its part of a whole-job state (see
        :mod:`commpress.comm.checkpoint`); the settings must be the saved ones."""
        what = f"{self.name}: load_state_dict"
        if self.flat.shard_group is not None:
            self._check_same_mesh(state, what)
        part = self.averager.own_part(state, what)
        checkpoint.check_config(part["config"], self.settings, what)
        self._load_part(part)
        self._check_resume = True

    def _check_same_mesh(self, state: Mapping[str, Any], what: str) -> None:
        """A sharded model's state loads on the mesh it was saved on only (its anchor,
        momentum and error feedback are this shard's rows in this many groups)."""
        config = state.get("config", {}) if isinstance(state, Mapping) else {}
        saved = (config.get("shard_shapes"), state.get("world_size") if isinstance(state, Mapping) else None)
        here = (self.settings["shard_shapes"], self.averager.world_size)
        if saved != here:
            raise ConfigError(
                f"{what}: the state was saved by a rank holding shards of shapes {saved[0]} in {saved[1]} replica "
                f"groups; this rank holds {here[0]} in {here[1]}: a sharded model's commpress state does not reshard "
                "(the model and optimizer do, through torch.distributed.checkpoint): resume on the mesh it was saved on"
            )

    def _load_part(self, part: Mapping[str, Any]) -> None:
        self.clock.load_state_dict(part["clock"])
        self.anchor.copy_(part["anchor"])
        self.outer_optimizer.load_state_dict(copy.deepcopy(part["outer"]))
        self.averager.load_state_dict(part["averager"])
