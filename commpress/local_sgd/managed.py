"""DiLoCo and Streaming DiLoCo under a torchft ``Manager``: outer syncs that survive a lost
replica group, with compressed pseudo-gradients.

As torchft's own DiLoCo runs them: every sync is one manager step. At a round's end the
replica asks for a quorum, averages one fragment's pseudo-gradient through the manager
(:class:`~commpress.comm.manager_backend.ManagerBackend`: every average divides by the
sync's participants) and, when it lands, asks ``should_commit()``. Committed: the outer
step and the merge, and the compressor's staged state is kept. Not committed (a peer lost,
a failed collective, too few replicas): the sync is skipped, as if it had not run: the
fragment keeps the steps taken since its last sync (an eager move made at the sync's start
taken back), the anchor, the outer state and the compressor's state stay as they were, and
the next sync takes the same fragment again, its pseudo-gradient covering those steps too
(torchft's own DiLoCo puts the fragment back at its anchor, dropping them). A non-finite
average puts the fragment back at its anchor (its values may hold the inf). The fragment
and the compressors' step come from the manager's step (committed syncs), so replicas that
joined at different times sync the same fragment with the same seeds; ``outer_lr =
"sqrt_replicas"`` takes the square root of each sync's participants (1.0 for a replica
syncing alone).

A (re)joining replica heals at its first sync: the manager hands it a healthy peer's
anchor, outer optimizer state and the compressor's shared state (registered with
``register_state_dict_fn``; the user registers the model and the inner optimizer, as in
torchft's examples); its input to that sync counts as zero, the collectives' results are
replayed on the received compressor state, and the outer step then leaves its anchor equal
to its peers'. Per-rank error feedback starts from zero there.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from commpress.comm import SimulatedWorld
from commpress.comm.averager import ParameterAverager
from commpress.comm.manager_backend import ManagerBackend, replay, report
from commpress.compressors import Context
from commpress.config import Config
from commpress.config.groups import MethodGroups
from commpress.config.tables import SQRT_REPLICAS
from commpress.errors import ConfigError
from commpress.local_sgd.diloco import DiLoCo, _InFlight
from commpress.local_sgd.fragments import Fragment
from commpress.local_sgd.periods import Constant, Period

__all__ = ["ManagedDiLoCo", "managed_from_config"]


class ManagedDiLoCo(DiLoCo):
    """:class:`DiLoCo` whose syncs go through ``manager`` (a ``torchft.Manager``), its
    shared state registered with it under ``key``. ``method`` and ``params`` compress the
    pseudo-gradients; the other arguments are :class:`DiLoCo`'s (a constant period)."""

    name = "DiLoCo under a torchft Manager"
    commits_when_averaged = False  # the manager's should_commit() decides

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        manager: Any,
        period: int | Period | None = None,
        method: str = "none",
        params: Mapping[str, Any] | None = None,
        key: str = "commpress_diloco",
        **kwargs: Any,
    ) -> None:
        if period is not None and not isinstance(period, (int, Constant)):
            raise ConfigError(f"{self.name}: period = {period!r} is not accepted; expected a constant period (an int)")
        self.manager = manager
        groups = MethodGroups(Config(method=method, params=dict(params or {})))
        averager = ParameterAverager(method, params, backend=ManagerBackend(manager, groups.rounds))
        self._settling = threading.RLock()  # the manager reads the shared state from its quorum thread
        self._replays: list[tuple[Fragment, Context]] = []  # per average in flight: what a replay needs
        super().__init__(model, inner_optimizer, period, averager=averager, **kwargs)
        self._base = manager.current_step()  # syncs are counted from here (0 in a fresh job, on every replica)
        self.commits: list[bool] = []  # should_commit() of every sync, in order
        self._healed = False  # set when the manager hands this replica a peer's state
        self._load_kernels(groups)
        manager.register_state_dict_fn(key, self.load_shared, self.shared_state_dict)

    def _load_kernels(self, groups: MethodGroups) -> None:
        """Run the method once on zeros in a world of one, before this replica's first
        quorum: a fresh process loads the compressor's CPU kernels from numba's cache here
        (0.9 s for TernGrad), not inside its first sync, which its peers wait for. Its own
        compressor (``groups`` is not the averager's), so no state of the real one changes."""
        fragment = self.fragments[0]
        zeros = torch.zeros(fragment.stop - fragment.start, dtype=self.anchor.dtype, device=self.anchor.device)
        reduction = groups.composite.reduce(fragment.bucket(zeros), Context(rank=0, world_size=1, step=0))
        SimulatedWorld(1).run([reduction])

    @property
    def backend(self) -> ManagerBackend:
        backend = self.averager.backend
        assert isinstance(backend, ManagerBackend)
        return backend

    @property
    def syncs(self) -> int:
        """Committed syncs since registration: the manager's step, the same on every replica."""
        return self.manager.current_step() - self._base

    def _check_ranks(self) -> None:
        """Membership is the manager's business: nothing to compare at a sync."""

    def _begin_step(self) -> None:
        self.manager.disallow_state_dict_read()  # the inner step changes the model a peer may be reading
        super()._begin_step()

    def _end_step(self) -> None:
        self.manager.allow_state_dict_read()
        super()._end_step()

    def _quorum(self) -> None:
        """A new manager step: its quorum, participants and this replica's role in it."""
        self.manager.allow_state_dict_read()  # a healing peer may read this replica's state now
        self.manager.start_quorum()
        self.backend.begin_step()
        self._follow_participants()

    def _follow_participants(self) -> None:
        """``outer_lr = "sqrt_replicas"``: sqrt(M), M this sync's participants (a healing
        replica's input counts as zero and it is not among them); every replica of the
        quorum sees the same M, so their outer steps stay bit for bit equal."""
        if self.outer_lr_setting == SQRT_REPLICAS:
            self._scale_outer_lr()

    def start_due(self, final: bool = False) -> None:
        """At a round's end: land what is in flight, then the next sync (a quorum, then the
        fragment of the manager's step). ``final``: land, then sync every fragment, each
        landing at once (replicas cannot know which fragments their peers changed)."""
        if final:
            self._land(until=None)
            for fragment in self.fragments:
                self._quorum()
                self._start_fragment(fragment, self.clock.step, replace=True)
                self._land(until=None)
            return
        if not self.clock.round_ends:
            return
        self._land(until=None)
        self._quorum()
        fragment = self.fragments[self.syncs % len(self.fragments)]
        self._start_fragment(fragment, self.clock.step + self.sync_delay)

    def _start_fragment(self, fragment: Fragment, due: int, replace: bool = False) -> None:
        self.averager.calls = self.syncs  # the compressors' step: the same on every replica
        self._replays.append((fragment, self.averager.next_context()))
        super()._start_fragment(fragment, due, replace)

    def _land_one(self, flight: _InFlight) -> None:
        """Wait for the average, ask the manager whether the sync counts, then the outer step
        and the merge, or the sync skipped (:meth:`_skip`)."""
        self._replays.pop(0)
        finite = True
        try:
            average = self._wait(flight.average)
        except Exception as exc:  # a failed collective or a non-finite average: the sync does not count
            report(self.manager, exc)
            average, finite = None, not isinstance(exc, FloatingPointError)
        committed = self.manager.should_commit()  # a healing replica takes its peer's state here
        self.commits.append(committed)
        with self._settling:
            self.averager.settle(committed and average is not None)
            healed, self._healed = self._healed, False
            if committed and average is not None:
                if healed and flight.start is not None:  # its model is now a peer's: no steps of its own to keep
                    flight = dataclasses.replace(flight, replace=True)
                self._apply(flight, average)
            elif healed or not finite:  # a peer's model, or values that may hold the inf: the anchor
                self._to_anchor(flight.fragment)
            else:
                self._skip(flight)

    def _skip(self, flight: _InFlight) -> None:
        """A sync that does not count leaves the fragment's local values as if it had not
        run: the steps taken since the fragment's last sync are kept (the next sync sends
        them), and an eager move made when it started is taken back, ``start - anchor``
        divided by the outer lr (an outer lr of 0 moved nothing: back to the anchor)."""
        if flight.start is None:
            return
        fragment = flight.fragment
        lr = self._outer_lr(fragment.index)
        if lr == 0:
            self._to_anchor(fragment)
            return
        anchor = self.anchor[fragment.where]
        local = self.flat.read(tensors=fragment.tensors)
        local.sub_(flight.start).add_(torch.lerp(anchor, flight.start, 1 / lr))  # the values before the move
        self.flat.write(local, fragment.tensors)
        self.fresh[fragment.index] = -1

    # ---- live recovery -----------------------------------------------------------------

    def shared_state_dict(self) -> dict[str, Any]:
        """What every replica shares and a healing one receives: the anchor, the outer
        optimizer's state and the compressor's state without its per-rank entries."""
        with self._settling:
            compressor = self.averager.compressor
            state = compressor.state_dict()
            shared = {k: ({} if k in compressor.per_rank_state else v) for k, v in state.items()}
            return {
                "anchor": self.anchor.clone(),
                "outer": copy.deepcopy(self.outer_optimizer.state_dict()),
                "compressor": shared,
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
            log = self.backend.log or []
            for (fragment, ctx), results in zip(self._replays, log):
                zeros = torch.zeros(fragment.stop - fragment.start, dtype=self.anchor.dtype, device=self.anchor.device)
                replay(self.averager.groups.composite.reduce(fragment.bucket(zeros), ctx), results)

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """This replica's state (:meth:`DiLoCo.state_dict`); ``full=True`` is refused: the
        replicas change between syncs."""
        if full:
            raise RuntimeError(
                f"{self.name}: state_dict(full=True) gathers fixed ranks; under a torchft Manager save each replica's "
                "own state_dict()"
            )
        return super().state_dict()


def managed_from_config(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config,
    manager: Any,
    total_steps: int | None = None,
    key: str = "commpress_diloco",
) -> ManagedDiLoCo:
    """The :class:`ManagedDiLoCo` of a config whose ``[local_sgd]`` table says
    ``algorithm = "diloco"`` or ``"local_sgd"`` with a constant period; the top-level
    ``method`` and ``params`` compress the pseudo-gradients; ``key`` names its state with
    the manager. Local SGD is DiLoCo whose outer step is the plain average (outer SGD at lr
    1, no momentum: the anchor becomes the replicas' mean), one fragment, no delay."""
    section = config.section("local_sgd")
    assert section is not None
    if section.algorithm == "co2" or section.qsr_alpha is not None:
        what = "algorithm = 'co2'" if section.algorithm == "co2" else "qsr_alpha (QSR)"
        raise ConfigError(
            f"[local_sgd] {what} does not run under a torchft Manager yet; expected algorithm = \"diloco\" (Streaming "
            "DiLoCo's fragments, sync_delay and merge included) or \"local_sgd\", with a constant period"
        )
    if section.algorithm == "local_sgd":
        outer = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False, "fragments": 1, "sync_delay": 0}
    else:
        outer = {k: section.value(k) for k in ("outer_lr", "outer_momentum", "nesterov", "fragments", "sync_delay")}
    return ManagedDiLoCo(
        model,
        optimizer,
        manager,
        section.period,
        method=config.method,
        params=config.params,
        average_buffers=section.average_buffers,
        total_steps=total_steps,
        key=key,
        merge=section.merge,
        merge_alpha=section.merge_alpha,
        **outer,
    )
