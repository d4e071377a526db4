"""What the Local SGD trainers under a torchft ``Manager`` (:mod:`commpress.local_sgd.managed`,
:mod:`commpress.local_sgd.managed_co2`) share: an averager whose collectives go through the
manager, one manager step per sync (a quorum, the average, ``should_commit()``), the
compressors' step taken from the manager's committed steps (so replicas that joined at
different times use the same seeds), state reads by a healing peer allowed only between
inner steps, and live recovery: a (re)joining replica receives a healthy peer's anchor,
outer optimizer state and compressor state (its per-rank entries left out: error feedback
starts from zero there), then replays the syncs in flight on that compressor state, so it
stages what its peers staged, and takes its peer's step count (:attr:`ManagerSyncs.job_step`),
so a loop driven by the job's step ends every replica at the same step; ``finish()`` warns
when it syncs with fewer replica groups than the job had.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from commpress.comm.averager import ParameterAverager
from commpress.comm.manager_backend import ManagerBackend, replay
from commpress.compressors import Context, without_per_rank
from commpress.config import Config
from commpress.config.groups import MethodGroups
from commpress.local_sgd.local_sgd import Average
from commpress.local_sgd.rounds import RoundClock
from commpress.local_sgd.warm import load_trainer_kernels

__all__ = ["ManagerSyncs"]

log = logging.getLogger("commpress.manager")

#: what a replayed sync needs: the bucket its values go in, their count, its context
Replay = tuple[Callable[[torch.Tensor], Any], int, Context]


class ManagerSyncs:
    """Mixed in before a :class:`~commpress.local_sgd.LocalSGD` trainer: call
    :meth:`_manager_averager` for the averager before the trainer's ``__init__``, :meth:`_register`
    after it, :meth:`_start_manager_step` and :meth:`_keep_for_replay` when a sync starts."""

    manager: Any
    name: str
    anchor: torch.Tensor
    averager: ParameterAverager
    outer_optimizer: torch.optim.Optimizer
    clock: RoundClock

    def _manager_averager(self, manager: Any, method: str, params: Mapping[str, Any] | None) -> ParameterAverager:
        """The averager of ``method`` whose collectives go through ``manager``."""
        self.manager = manager
        rounds = MethodGroups(Config(method=method, params=dict(params or {}))).rounds
        self._settling = threading.RLock()  # the manager reads the shared state from its quorum thread
        self._replays: list[Replay] = []  # per average in flight: what a replay needs
        return ParameterAverager(method, params, backend=ManagerBackend(manager, rounds))

    def _register(self, key: str) -> None:
        """Load the compressor's kernels, register the shared state with the manager under
        ``key`` (syncs count from the manager's step when the backend was made: 0 in a
        fresh job, on every replica)."""
        self.commits: list[bool] = []  # should_commit() of every sync, in order
        self._healed = False  # set when the manager hands this replica a peer's state
        self._at_quorum: dict[str, Any] | None = None  # the clock when this replica last asked for a quorum
        self._most = 0  # the most participants of any sync so far
        self._past_end = False  # warned that a sync started past total_steps
        load_trainer_kernels(self)  # type: ignore[arg-type]  # before the first quorum: its sync is not slowed
        self.backend.share_state(key, self.load_shared, self.shared_state_dict)

    @property
    def backend(self) -> ManagerBackend:
        backend = self.averager.backend
        assert isinstance(backend, ManagerBackend)
        return backend

    @property
    def job_step(self) -> int:
        """The job's step: the inner steps taken, the same on every replica group that syncs
        with this one. A (re)joining replica takes its peer's count when it heals (with the
        steps it took since that sync started, ``sync_delay``), so ``while trainer.job_step <
        total_steps:`` ends every replica at the same step, as a loop over a fixed number of
        batches per process does not (a restarted replica would run them all)."""
        return self.clock.step

    @property
    def syncs(self) -> int:
        """Committed syncs since registration: the manager's step, the same on every replica."""
        return self.backend.step_of(0)

    def _check_ranks(self) -> None:
        """Membership is the manager's business: nothing to compare at a sync."""

    def _begin_step(self) -> None:
        self.manager.disallow_state_dict_read()  # the inner step changes the model a peer may be reading
        super()._begin_step()  # type: ignore[misc]

    def _end_step(self) -> None:
        self.manager.allow_state_dict_read()
        super()._end_step()  # type: ignore[misc]

    def _start_manager_step(self) -> None:
        """A new manager step: its quorum, participants and this replica's role in it."""
        self.manager.allow_state_dict_read()  # a healing peer may read this replica's state now
        self._at_quorum = self.clock.state_dict()
        self.manager.start_quorum()
        self.backend.begin_step()
        self._most = max(self._most, self.backend.world_size)
        self._follow_participants()
        total = self.clock.total_steps
        if total is not None and self.clock.step > total and not self._past_end:
            self._past_end = True
            log.warning(
                "%s: a sync at step %d, past total_steps = %d: this replica trains past the job's end (its model will "
                "not be its peers'); end the loop at the job's step (while reg.local_sgd.job_step < total_steps)",
                self.name,
                self.clock.step,
                total,
            )

    def _follow_participants(self) -> None:
        """What changes with the sync's participants (nothing here)."""

    def _keep_for_replay(self, bucket: Callable[[torch.Tensor], Any], numel: int) -> None:
        """A sync of ``numel`` values put in ``bucket`` starts: the compressors' step is
        the manager's, and what a replay of it needs is kept until it lands."""
        self.averager.calls = self.syncs
        self._replays.append((bucket, numel, self.averager.next_context()))

    def _wait_and_ask(self, average: Average) -> tuple[torch.Tensor | None, bool, bool]:
        """Wait for the oldest sync in flight, ``average``, and ask the manager whether it
        counts (a healing replica takes its peer's state in ``should_commit``): the averaged
        values (None: a failed collective or a non-finite average), whether they are
        finite, whether the step commits."""
        self._replays.pop(0)
        values: torch.Tensor | None = None
        finite = True
        try:
            values = self._wait(average)  # type: ignore[attr-defined]
        except Exception as exc:  # a failed collective or a non-finite average: the sync does not count
            self.backend.survived(exc)
            finite = not isinstance(exc, FloatingPointError)
        committed = self.manager.should_commit()
        self.commits.append(committed)
        return values, finite, committed

    def shared_state_dict(self) -> dict[str, Any]:
        """What every replica shares and a healing one receives: the anchor, the outer
        optimizer's state, the compressor's state without its per-rank entries, and the
        step count (a restarted replica then chooses QSR's rounds as its peers do)."""
        with self._settling:
            compressor = self.averager.compressor
            shared = without_per_rank(compressor, compressor.state_dict())
            return {
                "anchor": self.anchor.clone(),
                "outer": copy.deepcopy(self.outer_optimizer.state_dict()),
                "compressor": shared,
                "clock": self.clock.state_dict(),
            }

    def load_shared(self, state: Mapping[str, Any]) -> None:
        """Take a healthy peer's shared state (the manager calls it in ``should_commit``),
        then replay the syncs in flight on the received compressor state, so this replica
        stages what its peers staged."""
        with self._settling:
            self._healed = True
            self.anchor.copy_(state["anchor"])
            self.outer_optimizer.load_state_dict(copy.deepcopy(state["outer"]))
            self._follow_participants()  # the peer's lr may be its last sync's, read before its quorum
            self.averager.compressor.load_state_dict(copy.deepcopy(state["compressor"]))
            self.clock.load_state_dict(self._peer_clock(state["clock"]))
            for (bucket, numel, ctx), results in zip(self._replays, self.backend.log or []):
                zeros = torch.zeros(numel, dtype=self.anchor.dtype, device=self.anchor.device)
                replay(self.averager.groups.composite.reduce(bucket(zeros), ctx), results)

    def _peer_clock(self, peer: Mapping[str, Any]) -> dict[str, Any]:
        """The step count a healing replica takes: ``peer``'s, read when the peer answered the
        quorum, plus what this replica's own clock did since its quorum (a delayed sync heals
        when it lands, ``sync_delay`` steps later: those steps, the round ended and the one
        begun). Healing in the quorum's own step, it is the peer's as it is (QSR's rounds too)."""
        at, now = self._at_quorum, self.clock.state_dict()
        if at is None or now == at:
            return dict(peer)
        shift = int(peer["step"]) - at["step"]
        return {
            "step": now["step"] + shift,
            "rounds": int(peer["rounds"]) + now["rounds"] - at["rounds"],
            "period": now["period"],
            "round_start": now["round_start"] + shift,
            "periods": [*peer["periods"], *now["periods"][len(at["periods"]) :]],
        }

    def finish(self) -> None:
        """The trainer's ``finish()`` (each of its syncs a manager step), then a WARNING on
        the ``commpress.manager`` logger if its last sync had fewer participants than this
        replica has synced with: a replica group was lost before the end, or stopped at
        another step while this one trained on (their models then differ)."""
        super().finish()  # type: ignore[misc]
        last = self.backend.world_size
        if last < self._most:
            log.warning(
                "%s: finish() at step %d synced with %d replica group(s), fewer than the %d this replica has synced "
                "with: either a group was lost before the end, or the groups stopped at different steps and this one "
                "trained on without them (its model is then not theirs); end every replica at the job's step "
                "(while reg.local_sgd.job_step < total_steps), which a restarted replica takes from its peers",
                self.name,
                self.clock.step,
                last,
                self._most,
            )

    def _load_part(self, part: Mapping[str, Any]) -> None:
        super()._load_part(part)  # type: ignore[misc]
        self._replays = []  # what was in flight was asked about when saved: nothing left to replay

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """This replica's state (the trainer's ``state_dict``); ``full=True`` is refused:
        the replicas change between syncs."""
        if full:
            raise RuntimeError(
                f"{self.name}: state_dict(full=True) gathers fixed ranks; under a torchft Manager save each replica's "
                "own state_dict()"
            )
        return super().state_dict()  # type: ignore[misc]
