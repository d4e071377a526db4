"""What every Local SGD trainer is: every rank takes optimizer steps on its own, and at the
end of a round (a constant H, or QSR) the pseudo-gradient ``anchor - local`` is averaged
over ranks and the outer optimizer, a ``torch.optim.Optimizer`` over the anchor, steps the
anchor with it. :class:`~commpress.local_sgd.LocalSGD`, :class:`~commpress.local_sgd.DiLoCo`
and :class:`~commpress.local_sgd.CO2` say when a sync starts and lands, and which outer
optimizer steps it.

Every sync is one step of the averager's backend's transaction
(:mod:`commpress.local_sgd.transaction`): on a fixed process group it always counts. Under
a torchft ``Manager`` (an averager built with ``manager=``) a sync that does not count (a
peer lost, a failed collective, a non-finite average) is skipped as if it had not run, and
a (re)joining replica heals at its first sync from a healthy peer's shared state
(:meth:`Trainer.shared_state_dict`; the user registers the model and the inner optimizer,
as in torchft's examples). ``docs/fault_tolerance.md`` tells the whole story."""

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
from commpress.local_sgd.periods import Period
from commpress.local_sgd.rounds import RoundClock
from commpress.local_sgd.transaction import SyncTransaction

__all__ = ["Trainer"]


class Trainer(BoundToProcess):
    """What every Local SGD trainer (:class:`~commpress.local_sgd.LocalSGD`,
    :class:`~commpress.local_sgd.DiLoCo`, :class:`~commpress.local_sgd.CO2`) is: call
    :meth:`step` in place of ``optimizer.step()``, or call :meth:`register_optimizer_hooks`
    once and keep calling ``optimizer.step()`` (what :func:`commpress.register` does); a
    subclass says when a round's sync starts (:meth:`start_due`) and lands (:meth:`apply_due`).

    ``period``: an int (a round of ``period`` steps) or a :class:`Period` such as
    :class:`QSR` (None: the ``[local_sgd]`` table's default). ``averager``: a
    :class:`~commpress.comm.averager.ParameterAverager` (built with ``manager=``: under a
    torchft Manager), or a compressor name (``"none"``, ``"bf16"``, ...) for the averaging
    all-reduce. ``average_buffers`` also averages floating-point buffers (BatchNorm
    statistics). ``total_steps`` lets QSR cap the last round at the last step. ``key`` names
    the shared state a healing replica receives under a manager (default
    ``"commpress_<algorithm>"``).

    ``wait_seconds`` records how long each averaging blocked the caller. A non-finite
    average raises ``FloatingPointError`` on every rank and changes nothing (under a torchft
    Manager the sync does not count).

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
        self.outer_optimizer = self._outer_optimizer(self.outer_params)
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
        """The job's step: the inner steps taken, the same on every replica group that syncs
        with this one. Under a torchft Manager a (re)joining replica takes its peer's count
        when it heals (with the steps it took since that sync started, ``sync_delay``), so
        ``while trainer.job_step < total_steps:`` ends every replica at the same step, as a
        loop over a fixed number of batches per process does not (a restarted replica would
        run them all)."""
        return self.clock.step

    @property
    def syncs(self) -> int:
        """Syncs counted: the backend's step (under a torchft Manager the committed ones since
        the trainer was made, the same on every replica whenever it joined)."""
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
        self.backend.allow_state_reads(False)  # the inner step changes the model a healing peer may be reading
        self.clock.begin_step(float(self.optimizer.param_groups[0]["lr"]))

    def _end_step(self) -> None:
        self.backend.allow_state_reads(True)
        self.clock.end_step()
        self.start_due()
        self.apply_due()

    def _check_ranks(self) -> None:
        """After a load, fixed ranks compare step and settings at the first sync (under a
        torchft Manager membership is the manager's business)."""
        if self._check_resume and self.averager.can_block and self.backend.fixed_members:
            checkpoint.check_resume(self.backend, self.clock.step, digest_of(self.settings), self.name)
        self._check_resume = False

    def _begin_sync(self) -> None:
        """A sync begins: the ranks' check after a load, the backend's step (a quorum under a
        torchft Manager), and what follows the participants."""
        self._check_ranks()
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
        """End of training: land what is in flight and sync every fragment changed since the
        last sync (CO2: apply the last average), so every rank ends with the same model; under
        a torchft Manager a WARNING if the last sync had fewer replica groups than before."""
        self.start_due(final=True)
        self.apply_due(final=True)
        self.transaction.warn_if_fewer(self.clock.step)

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

    def shared_state_dict(self) -> dict[str, Any]:
        """What every replica shares and a healing one receives under a torchft Manager: the
        anchor, the outer optimizer's state, the compressor's state without its per-rank
        entries (error feedback starts from zero there), and the step count."""
        with self.transaction.lock:
            compressor = self.averager.compressor
            return {
                "anchor": self.anchor.clone(),
                "outer": copy.deepcopy(self.outer_optimizer.state_dict()),
                "compressor": without_per_rank(compressor, compressor.state_dict()),
                "clock": self.clock.state_dict(),
            }

    def load_shared(self, state: Mapping[str, Any]) -> None:
        """Take a healthy peer's shared state (the manager calls it in ``should_commit``),
        then replay the syncs in flight on the received compressor state."""
        with self.transaction.lock:
            self.transaction.healed = True
            self.anchor.copy_(state["anchor"])
            self.outer_optimizer.load_state_dict(copy.deepcopy(state["outer"]))
            self._follow_participants()  # the peer's lr may be its last sync's, read before its quorum
            self.averager.compressor.load_state_dict(copy.deepcopy(state["compressor"]))
            self.transaction.took_clock(self.clock, state["clock"])
            self.transaction.replay(self.anchor.dtype, self.anchor.device)

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """Step and round counters, H, the anchor, the outer optimizer's state, the syncs in
        flight (with how each lands) and the averager's state (save the model and the
        optimizer alongside, as usual), tagged with this rank, the world size and the
        settings; ``full=True``: every rank's (a collective; see
        :meth:`commpress.CommState.state_dict`)."""
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
        part = checkpoint.tag(self._part(), backend.rank, backend.world_size, self.clock.step, self.settings)
        return checkpoint.gather_job(backend.allgather_object, part) if full else part

    def _part(self) -> dict[str, Any]:
        """The syncs in flight (asked first whether each counts, as landing it would), then
        counters, anchor, the outer optimizer's state and the averager's state."""
        syncs = self._syncs_part()
        return {
            "clock": self.clock.state_dict(),
            "anchor": self.anchor.clone(),
            "outer": copy.deepcopy(self.outer_optimizer.state_dict()),
            "averager": self.averager.state_dict(),
            **syncs,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's part, or its part of a whole-job state (see
        :mod:`commpress.comm.checkpoint`); the settings must be the saved ones."""
        what = f"{self.name}: load_state_dict"
        if self.flat.shard_group is not None:  # its anchor, momentum and error feedback are this shard's rows
            checkpoint.check_same_mesh(state, self.settings["shard_shapes"], self.averager.world_size, what)
        part = self.averager.own_part(state, what)
        checkpoint.check_config(part["config"], self.settings, what)
        self._load_part(part)
        self._check_resume = True

    def _load_part(self, part: Mapping[str, Any]) -> None:
        self.clock.load_state_dict(part["clock"])
        self.anchor.copy_(part["anchor"])
        self.outer_optimizer.load_state_dict(copy.deepcopy(part["outer"]))
        self.averager.load_state_dict(part["averager"])
        self.transaction.forget_replays()  # what was in flight was asked about when saved
        self._load_syncs(part)

    def _syncs_part(self) -> dict[str, Any]:
        """The syncs in flight, as a restored run lands them."""
        raise NotImplementedError

    def _load_syncs(self, part: Mapping[str, Any]) -> None:
        raise NotImplementedError

