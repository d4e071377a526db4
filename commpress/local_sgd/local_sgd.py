"""Local SGD: every rank takes optimizer steps on its own, and the ranks average their
models when the period policy says so (a constant H, or QSR).

The mechanism DiLoCo and CO2 share: at the end of a round the pseudo-gradient
``anchor - local`` (of the whole model, or of one fragment) is averaged over ranks, landed
``sync_delay`` steps later, and applied to the anchor by the :class:`OuterStep`; the local
model then takes the new anchor (or, with ``merge_alpha``, a mix of it and its own values).
Plain Local SGD lands at once with lr 1 and no momentum: the anchor becomes the average."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from commpress.comm import Traffic, checkpoint
from commpress.comm.agreement import agree_on_settings
from commpress.comm.pickling import BoundToProcess
from commpress.compressors import host
from commpress.compressors.registry import methods_taking
from commpress.config import digest_of
from commpress.errors import ConfigError
from commpress.local_sgd.averaging import ParameterAverager
from commpress.local_sgd.ddp import skip_gradient_allreduce
from commpress.local_sgd.flat import FlatModel
from commpress.local_sgd.fragments import Fragment, split
from commpress.local_sgd.outer import OuterStep
from commpress.local_sgd.periods import Period
from commpress.local_sgd.rounds import RoundClock

__all__ = ["LocalSGD", "check_finite"]


def check_finite(average: torch.Tensor, name: str, round_index: int) -> None:
    """Refuse a non-finite average before it reaches the anchor (or CO2's momentum): every
    rank holds the same average, so every rank raises, and the state stays as it was."""
    if not host.flags(host.finite(average))[0]:
        raise FloatingPointError(
            f"{name}: the average of round {round_index} is not finite (a rank's model holds inf or NaN); "
            "the anchor and the outer state were left unchanged: restore a checkpoint or lower the learning rate"
        )


@dataclass
class _InFlight:
    """A fragment's pseudo-gradient being averaged (in place, in ``buffer``) and the step
    count at which it lands; ``replace``: the local values then take the anchor's whatever
    ``merge_alpha`` (the final syncs of :meth:`LocalSGD.finish`)."""

    fragment: Fragment
    due: int
    round: int
    future: torch.futures.Future
    buffer: torch.Tensor
    replace: bool = False


class LocalSGD(BoundToProcess):
    """Call :meth:`step` in place of ``optimizer.step()``; it averages the model across
    ranks at the end of every round. Or call :meth:`register_optimizer_hooks` once and keep
    calling ``optimizer.step()`` (what :func:`commpress.register` does).

    ``period``: an int (average every ``period`` steps) or a :class:`Period` such as
    :class:`QSR`. ``averager``: a :class:`ParameterAverager`, or a compressor name
    (``"none"``, ``"bf16"``, ...) for the averaging all-reduce. ``average_buffers`` also
    averages floating-point buffers (BatchNorm statistics). ``total_steps`` lets QSR cap
    the last round at the last step.

    ``wait_seconds`` records how long each averaging blocked the caller. A non-finite
    average raises ``FloatingPointError`` on every rank and changes nothing.

    With DDP, a comm hook that keeps gradients local is registered here (construct before
    the first backward); a plain module gets rank 0's values at construction. The optimizer
    state (momenta, Adam moments) stays local: only the model is averaged.

    With an averager whose backend cannot block (``can_block`` false: ranks of a
    :class:`commpress.comm.SimulatedWorld`, all in one thread) the set-up agreement and
    broadcast are left out: build every rank's
    trainer from one config and identical models. Such ranks take their steps one after
    another through :meth:`local_step` (every rank) and then :meth:`apply_due` (every rank);
    :meth:`finish` likewise as ``start_due(final=True)``, then ``apply_due(final=True)``.
    """

    name = "local SGD"
    #: the streaming settings of :class:`commpress.local_sgd.DiLoCo`; Local SGD syncs the
    #: whole model and lands it at once
    fragment_count = 1
    sync_delay = 0
    merge_alpha = 0.0

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        period: int | Period = 4,
        process_group: Any = None,
        averager: ParameterAverager | str | None = None,
        average_buffers: bool = False,
        total_steps: int | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.clock = RoundClock(period, total_steps, self.name)
        is_ddp = isinstance(model, DistributedDataParallel)
        if process_group is None and is_ddp:
            process_group = model.process_group
        if not isinstance(averager, ParameterAverager):
            averager = ParameterAverager(averager or "none", process_group=process_group)
        self.averager = averager
        in_process = not self.averager.backend.can_block  # no blocking set-up (class docstring)
        #: what every rank must share, and a checkpoint must have been saved with
        self.settings = {"algorithm": self.name, "period": repr(period), "averager": self.averager.method, **self._settings()}
        self.settings["model"] = [[n, list(p.shape)] for n, p in model.named_parameters()]
        if not in_process:
            agree_on_settings(self.settings, self.name, "torch" if dist.is_initialized() else "mpi", process_group)
        self._check_resume = False  # after a load: ranks compare step and settings at the next averaging
        self.flat = FlatModel(model, buffers=average_buffers)
        compressor = self.averager.compressor
        if self.flat.dtype not in compressor.dtypes:
            dtype = str(self.flat.dtype).removeprefix("torch.")
            takers = methods_taking(self.flat.dtype)
            advice = f"average with {' / '.join(takers)}, or convert the model" if takers else "convert the model"
            raise ConfigError(
                f"{self.name} averages the model's {dtype} values with method {compressor.name!r}, which does not "
                f"take {dtype}: {advice}"
            )
        #: the last average, identical on every rank; rounds average differences from it
        self.anchor = self.flat.read()
        if is_ddp:
            skip_gradient_allreduce(model)  # DDP already broadcast rank 0's model
        elif not in_process:
            self.averager.broadcast(self.anchor)
            self.flat.write(self.anchor)
        self.outer = self._outer_step()
        self.fragments = split(self.flat.slots, self.fragment_count, self.name)
        #: per fragment, the step count at which its local values last equalled the anchor
        self.fresh = [0] * len(self.fragments)
        self._in_flight: list[_InFlight] = []
        self.wait_seconds: list[float] = []
        self._hooks: list[RemovableHandle] = []

    def _outer_step(self) -> OuterStep:
        """Plain averaging: lr 1, no momentum."""
        return OuterStep(self.anchor)

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

    def _begin_step(self) -> None:
        self.clock.begin_step(float(self.optimizer.param_groups[0]["lr"]))

    def _end_step(self) -> None:
        self.clock.end_step()
        self.start_due()
        self.apply_due()

    def _check_ranks(self) -> None:
        """After a load, the ranks compare step and settings at the first sync."""
        if self._check_resume and self.averager.backend.can_block:
            checkpoint.check_resume(self.averager.backend, self.clock.step, digest_of(self.settings), self.name)
        self._check_resume = False

    def start_due(self, final: bool = False) -> None:
        """Start the average the step just counted is due to start: the fragment
        ``rounds % fragments`` at the end of a round. ``final``: land what is in flight,
        then start every fragment whose local values differ from the anchor (finish)."""
        if final:
            self._land(until=None)
            for fragment in self.fragments:
                if self.fresh[fragment.index] != self.clock.step:
                    self._start(fragment, self.clock.step, replace=True)
            return
        if not self.clock.round_ends:
            return
        self._check_ranks()
        self._land(until=None)  # a round shorter than sync_delay (QSR's last) lands the previous first
        self._start(self.fragments[self.clock.rounds % len(self.fragments)], self.clock.step + self.sync_delay)

    def apply_due(self, final: bool = False) -> None:
        """Land the averages due by this step (``final``: all in flight), then end the
        round if this step ended it (``final``: if steps were taken in it). A failed
        average (a peer lost, a non-finite value) raises before the round is counted."""
        self._land(until=None if final else self.clock.step)
        if self.clock.round_ends or (final and self.clock.in_round):
            self.clock.round_done()

    def _land(self, until: int | None) -> None:
        """Land, in the order they started, the averages due by step ``until`` (None: all)."""
        while self._in_flight and (until is None or self._in_flight[0].due <= until):
            self._land_one(self._in_flight.pop(0))

    def _start(self, fragment: Fragment, due: int, replace: bool = False) -> None:
        buffer = self.flat.read(tensors=fragment.tensors)
        torch.sub(self.anchor[fragment.where], buffer, out=buffer)
        future = self.averager.start(fragment.bucket(buffer))
        self._in_flight.append(_InFlight(fragment, due, self.clock.rounds, future, buffer, replace))

    def _land_one(self, flight: _InFlight) -> None:
        """The outer step with the averaged pseudo-gradient, then the merge of the local values."""
        t0 = time.perf_counter()
        flight.future.wait()
        self.wait_seconds.append(time.perf_counter() - t0)
        check_finite(flight.buffer, self.name, flight.round)
        where, tensors = flight.fragment.where, flight.fragment.tensors
        self.outer.apply(self.anchor, flight.buffer, where)
        if flight.replace or self.merge_alpha == 0:
            self.flat.write(self.anchor[where], tensors)
            self.fresh[flight.fragment.index] = self.clock.step
        else:
            local = self.flat.read(tensors=tensors)
            self.flat.write(local.mul_(self.merge_alpha).add_(self.anchor[where], alpha=1 - self.merge_alpha), tensors)
            self.fresh[flight.fragment.index] = -1

    def finish(self) -> None:
        """End of training: land what is in flight, then sync every fragment changed since
        its last sync (the steps since the last averaging, a merge's local part), so every
        rank ends with the same model."""
        self.start_due(final=True)
        self.apply_due(final=True)

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """Step and round counters, H, the anchor, the outer momentum, the fragments'
        state and averages in flight, and the averager's state (save the model and the
        optimizer alongside, as usual), tagged with this rank, the world size
        and the settings; ``full=True``: every rank's (a collective; see
        :meth:`commpress.CommState.state_dict`)."""
        backend = self.averager.backend
        part = checkpoint.tag(self._part(), backend.rank, backend.world_size, self.clock.step, self.settings)
        return checkpoint.gather_job(backend.allgather_object, part) if full else part

    def _part(self) -> dict[str, Any]:
        """Counters, anchor, outer momentum, fragment freshness, the averages in flight
        (waited for, so a restored run lands the same values at the same steps) and the
        averager's state."""
        in_flight = []
        for flight in self._in_flight:
            flight.future.wait()
            in_flight.append(
                {
                    "fragment": flight.fragment.index,
                    "due": flight.due,
                    "round": flight.round,
                    "average": flight.buffer.clone(),
                    "replace": flight.replace,
                }
            )
        return {
            "clock": self.clock.state_dict(),
            "anchor": self.anchor.clone(),
            "momentum": None if self.outer.momentum is None else self.outer.momentum.clone(),
            "fresh": list(self.fresh),
            "in_flight": in_flight,
            "averager": self.averager.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's part, or its part of a whole-job state (see
        :mod:`commpress.comm.checkpoint`); the settings must be the saved ones."""
        what = f"{self.name}: load_state_dict"
        part = self.averager.own_part(state, what)
        checkpoint.check_config(part["config"], self.settings, what)
        self._load_part(part)
        self._check_resume = True

    def _load_part(self, part: Mapping[str, Any]) -> None:
        self.clock.load_state_dict(part["clock"])
        self.anchor.copy_(part["anchor"])
        if self.outer.momentum is not None:
            self.outer.momentum.copy_(part["momentum"])
        self.fresh = [int(step) for step in part["fresh"]]
        self._in_flight = []
        for saved in part["in_flight"]:
            done: torch.futures.Future = torch.futures.Future()
            buffer = saved["average"].clone()
            done.set_result(buffer)
            fragment = self.fragments[saved["fragment"]]
            self._in_flight.append(_InFlight(fragment, int(saved["due"]), int(saved["round"]), done, buffer, saved["replace"]))
        self.averager.load_state_dict(part["averager"])
