"""The base of every Local SGD trainer: ranks step on their own, and at a round's end the
pseudo-gradient ``anchor - local`` is averaged for an outer optimizer to step the anchor with.
Each sync is one step of the backend's transaction (:mod:`commpress.local_sgd.transaction`);
``docs/fault_tolerance.md`` tells how replicas heal under a torchft ``Manager``."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from commpress.comm import Traffic, checkpoint
from commpress.comm.averager import ParameterAverager
from commpress.comm.pickling import BoundToProcess
from commpress.compressors import without_per_rank
from commpress.config import digest_of
from commpress.config.tables import LocalSGDConfig
from commpress.local_sgd.average import Average, check_finite
from commpress.local_sgd.ddp import skip_gradient_allreduce
from commpress.local_sgd.flat import FlatModel
from commpress.local_sgd.outer import OuterOptimizer, describe_optimizer
from commpress.local_sgd.periods import Period
from commpress.local_sgd.rounds import RoundClock
from commpress.local_sgd.transaction import SyncTransaction

__all__ = ["Trainer"]


class Trainer(BoundToProcess):
    """The base of :class:`~commpress.local_sgd.LocalSGD`, :class:`~commpress.local_sgd.DiLoCo`
    and :class:`~commpress.local_sgd.CO2`: call :meth:`step` in place of ``optimizer.step()``, or
    :meth:`register_optimizer_hooks` once (what :func:`commpress.register` does).

    ``period``: an int or a :class:`Period` such as :class:`QSR`. ``averager``: a
    :class:`~commpress.comm.averager.ParameterAverager` (built with ``manager=`` under a torchft
    Manager) or a compressor name. ``average_buffers`` also averages float buffers (BatchNorm
    statistics); ``key`` names the shared state; arguments left None take the ``[local_sgd]``
    defaults. A non-finite average raises ``FloatingPointError`` on every rank, changing nothing.

    A DDP model's gradients stay local from construction (before its first backward); a plain
    module takes rank 0's values then, except on ranks that cannot block (a
    :class:`commpress.comm.SimulatedWorld`): build those from identical models and run
    :meth:`local_step`, then :meth:`apply_due`, on every rank.
    """

    name = "local SGD"
    #: the ``[local_sgd]`` table's algorithm, whose defaults fill the arguments left None
    algorithm = "local_sgd"
    #: a user's outer optimizer builder (None: the trainer's own, :meth:`_outer_optimizer`)
    _given_outer: OuterOptimizer | None = None

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        period: int | Period | None = None,
        process_group: Any = None,
        averager: ParameterAverager | str | None = None,
        average_buffers: bool = False,
        total_steps: int | None = None,
        key: str | None = None,
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
        given = self._given_outer
        self.outer_optimizer = self._outer_optimizer(self.outer_params) if given is None else given(self.outer_params)
        #: what every rank must share, and a checkpoint must have been saved with
        self.settings = {"algorithm": self.name, "period": repr(period), "averager": self.averager.method, **self._settings()}
        self.settings["model"] = [[n, list(p.shape)] for n, p in model.named_parameters()]
        if self.flat.shard_group is not None:  # a shard of the model: a checkpoint holds this shard's rows
            self.settings["shard_shapes"] = [list(s.shape) for s in self.flat.slots]
        self.averager.connect(self.settings, self.name, process_group)  # the one set-up exchange
        self._check_resume = False  # after a load: ranks compare step and settings at the next averaging
        self.averager.check_takes(self.flat.dtype, f"{self.name} averages the model's")
        #: what keeps DDP's gradients local (None for a plain module)
        self.ddp_switch = skip_gradient_allreduce(model) if is_ddp else None  # DDP broadcast rank 0's model
        self.backend = self.averager.backend
        fixed = self.backend.fixed_members  # under a torchft Manager a replica heals from a peer instead
        if not is_ddp and self.averager.can_block and fixed:  # ranks in one thread start from identical models (class docstring)
            self.averager.broadcast(self.anchor)
            self.flat.write(self.anchor)
        self.transaction = SyncTransaction(self.averager, self.name)
        self._no_syncs()
        self.wait_seconds: list[float] = []
        self._hooks: list[RemovableHandle] = []
        self.backend.share_state(key or f"commpress_{self.algorithm}", self.load_shared, self.shared_state_dict)

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

    def _outer_settings(self, built_in: dict[str, Any]) -> dict[str, Any]:
        """``built_in``, the settings of the trainer's own outer optimizer, or the user's one described."""
        return built_in if self._given_outer is None else {"outer_optimizer": describe_optimizer(self.outer_optimizer)}

    @property
    def period(self) -> int | None:
        """H of the current round (None between an averaging and the next step)."""
        return self.clock.period

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent for averaging."""
        return self.averager.traffic

    @property
    def job_step(self) -> int:
        """The job's step: inner steps taken, the same on every replica group (a healer takes its
        peer's), so ``while trainer.job_step < total_steps:`` ends every replica at the same step,
        as a fixed batch count per process does not (a restarted replica would run them all)."""
        return self.clock.step

    @property
    def syncs(self) -> int:
        """Syncs counted: the backend's step (the same on every replica, whenever it joined)."""
        return self.backend.step_of(self.clock.rounds)

    @property
    def commits(self) -> list[bool]:
        """Whether each sync counted, in order (always, on a fixed group)."""
        return self.transaction.commits

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
        """:meth:`step` without landing the averages due, for ranks run in one thread (class docstring;
        :meth:`finish` is then ``start_due(final=True)``, then ``apply_due(final=True)``)."""
        self._begin_step()
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.clock.end_step()
        self.start_due()
        return loss

    def register_optimizer_hooks(self) -> None:
        """Run the rounds from ``optimizer.step()``'s hooks (as torchft runs DiLoCo), so the loop keeps
        calling it; a step GradScaler skips is not counted, and :meth:`step` is refused."""
        if not self._hooks:
            self._hooks = [
                self.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._begin_step()),
                self.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self._end_step()),
            ]

    def remove_hooks(self) -> None:
        """Take this trainer's hooks off the optimizer and the DDP model (after :meth:`finish`)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.ddp_switch is not None:
            self.ddp_switch.remove()

    def _begin_step(self) -> None:
        self.backend.allow_state_reads(False)  # the inner step changes the model a healing peer may be reading
        self.clock.begin_step(float(self.optimizer.param_groups[0]["lr"]))

    def _end_step(self) -> None:
        self.backend.allow_state_reads(True)
        self.clock.end_step()
        self.start_due()
        self.apply_due()

    def _begin_sync(self) -> None:
        """A sync begins: after a load, fixed ranks compare step and settings; the backend's step opens;
        what follows the participants follows them."""
        if self._check_resume and self.averager.can_block and self.backend.fixed_members:
            checkpoint.check_resume(self.backend, self.clock.step, digest_of(self.settings), self.name)
        self._check_resume = False
        self.transaction.begin(self.clock)
        self._follow_participants()

    def _follow_participants(self) -> None:
        """What changes with the sync's participants (nothing here)."""

    def _no_syncs(self) -> None:
        """No sync in flight yet."""
        raise NotImplementedError

    def start_due(self, final: bool = False) -> None:
        """Start the sync the step just counted is due to start (``final``: the last ones)."""
        raise NotImplementedError

    def apply_due(self, final: bool = False) -> None:
        """Land the syncs due by this step (``final``: all)."""
        raise NotImplementedError

    def _start_average(self, pseudo_gradient: torch.Tensor, bucket: Callable[[torch.Tensor], Any]) -> Average:
        """Start averaging ``pseudo_gradient`` as ``bucket`` (its replay kept), its compressor state staged until it lands."""
        self.transaction.keep_for_replay(bucket, pseudo_gradient.numel())
        return Average(self.averager.start(bucket(pseudo_gradient), commit=False), pseudo_gradient, self.clock.rounds)

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
        """The outer optimizer's step of ``outer_params[index]`` alone, with ``average`` as its gradient."""
        param = self.outer_params[index]
        param.grad = average
        try:
            self.outer_optimizer.step()
        finally:
            param.grad = None

    def finish(self) -> None:
        """End of training: land and sync what is left, so every rank ends with the same model."""
        self.start_due(final=True)
        self.apply_due(final=True)
        self.transaction.warn_if_fewer(self.clock.step)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """The anchor (the model at its last sync, the same on every rank) in place of this rank's
        parameters for the block: evaluate or save the job's model mid-run without a collective."""
        own = self.flat.read()
        self.flat.write(self.anchor)
        try:
            yield
        finally:
            self.flat.write(own)

    def shared_state_dict(self) -> dict[str, Any]:
        """What a healing replica receives under a torchft Manager: the anchor, the outer state, the
        compressor's state without per-rank entries (error feedback restarts at zero), the clock."""
        with self.transaction.lock:
            compressor = self.averager.compressor
            return {
                "anchor": self.anchor.clone(),
                "outer": copy.deepcopy(self.outer_optimizer.state_dict()),
                "compressor": without_per_rank(compressor, compressor.state_dict()),
                "clock": self.clock.state_dict(),
            }

    def load_shared(self, state: Mapping[str, Any]) -> None:
        """Take a healthy peer's shared state (in ``should_commit``) and replay the syncs in flight on it."""
        with self.transaction.lock:
            self.transaction.healed = True
            self.anchor.copy_(state["anchor"])
            self.outer_optimizer.load_state_dict(copy.deepcopy(state["outer"]))
            self._follow_participants()  # the peer's lr may be its last sync's, read before its quorum
            self.averager.compressor.load_state_dict(copy.deepcopy(state["compressor"]))
            self.transaction.took_clock(self.clock, state["clock"])
            self.transaction.replay(self.anchor.dtype, self.anchor.device)

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """The clock, anchor, outer and averager states and the syncs in flight (save the model and
        optimizer alongside), tagged with rank, world size and settings; ``full=True``: every
        rank's (a collective; see :meth:`commpress.CommState.state_dict`)."""
        backend = self.backend
        if full and not backend.fixed_members:
            raise RuntimeError(
                f"{self.name}: state_dict(full=True) gathers fixed ranks; under a torchft Manager save each replica's "
                "own state_dict()"
            )
        if full and self.flat.shard_group is not None:
            raise ValueError(
                f"{self.name}: state_dict(full=True) gathers the ranks holding this rank's shard only, not the other "
                "shards: save every rank's state_dict() (torch.save on every rank, or torch.distributed.checkpoint "
                "with Registration.stateful(model, optimizer))"
            )
        syncs = self._syncs_part()  # first: asked whether each counts, as landing would
        part = {
            "clock": self.clock.state_dict(),
            "anchor": self.anchor.clone(),
            "outer": copy.deepcopy(self.outer_optimizer.state_dict()),
            "averager": self.averager.state_dict(),
            **syncs,
        }
        part = checkpoint.tag(part, backend.rank, backend.world_size, self.clock.step, self.settings)
        return checkpoint.gather_job(backend.allgather_object, part) if full else part

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's part, or its part of a whole-job state; the settings must be the saved ones."""
        what = f"{self.name}: load_state_dict"
        if self.flat.shard_group is not None:  # its anchor, momentum and error feedback are this shard's rows
            checkpoint.check_same_mesh(state, self.settings["shard_shapes"], self.averager.world_size, what)
        part = self.averager.own_part(state, what)
        checkpoint.check_config(part["config"], self.settings, what)
        self.clock.load_state_dict(part["clock"])
        self.anchor.copy_(part["anchor"])
        self.outer_optimizer.load_state_dict(copy.deepcopy(part["outer"]))
        self.averager.load_state_dict(part["averager"])
        self.transaction.forget_replays()  # what was in flight was asked about when saved
        self._load_syncs(part)
        self._check_resume = True

    def _syncs_part(self) -> dict[str, Any]:
        """The syncs in flight, as a restored run lands them."""
        raise NotImplementedError

    def _load_syncs(self, part: Mapping[str, Any]) -> None:
        raise NotImplementedError
