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
to its peers'. Per-rank error feedback starts from zero there. It takes its peer's step
count too (the steps it took since the sync started added: ``sync_delay``), so the job's
step (:attr:`~commpress.local_sgd.manager_syncs.ManagerSyncs.job_step`) is the same on every
replica that syncs: a loop ``while trainer.job_step < total_steps`` ends them all at the
same step, and ``finish()`` (a manager step per fragment) pairs their last syncs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from commpress.config import Config
from commpress.config.tables import SQRT_REPLICAS
from commpress.local_sgd.config import period_policy
from commpress.local_sgd.diloco import DiLoCo, _InFlight
from commpress.local_sgd.fragments import Fragment
from commpress.local_sgd.managed_co2 import ManagedCO2
from commpress.local_sgd.manager_syncs import ManagerSyncs
from commpress.local_sgd.periods import Period

__all__ = ["ManagedDiLoCo", "managed_from_config"]


class ManagedDiLoCo(ManagerSyncs, DiLoCo):
    """:class:`DiLoCo` whose syncs go through ``manager`` (a ``torchft.Manager``), its
    shared state registered with it under ``key``. ``method`` and ``params`` compress the
    pseudo-gradients; the other arguments are :class:`DiLoCo`'s."""

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
        averager = self._manager_averager(manager, method, params)
        super().__init__(model, inner_optimizer, period, averager=averager, **kwargs)
        #: per sync in flight, oldest first, how it lands once asked (:meth:`_outcome_of`)
        self._outcomes: list[str] = []
        self._register(key)

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
            self._apply_syncs_due(until=None)
            for fragment in self.fragments:
                self._start_manager_step()
                self._start_fragment(fragment, self.clock.step, replace=True)
                self._apply_syncs_due(until=None)
            return
        if not self.clock.round_ends:
            return
        self._apply_syncs_due(until=None)
        self._start_manager_step()
        fragment = self.fragments[self.syncs % len(self.fragments)]
        self._start_fragment(fragment, self.clock.step + self.sync_delay)

    def _start_fragment(self, fragment: Fragment, due: int, replace: bool = False) -> None:
        self._keep_for_replay(fragment.bucket, fragment.stop - fragment.start)
        super()._start_fragment(fragment, due, replace)

    def _land_one(self, flight: _InFlight) -> None:
        """Land a sync: the outer step and the merge, or the sync skipped (:meth:`_skip_sync`).
        Whether it counts is asked now (:meth:`_wait_and_ask`), or was when the state was saved."""
        if self._outcomes:
            outcome = self._outcomes.pop(0)
            with self._settling:
                self._apply_outcome(flight, outcome)
            return
        verdict = self._wait_and_ask(flight.average)
        with self._settling:  # the compressor's state and the anchor change together for a reading peer
            self._apply_outcome(flight, self._outcome_of(flight, *verdict))

    def _outcome_of(self, flight: _InFlight, average: torch.Tensor | None, finite: bool, committed: bool) -> str:
        """Keep or drop the compressor's staged state; how the sync lands: ``"apply"``,
        ``"replace"`` (applied, the local values taking the anchor's: a healed replica's
        model is its peer's, no steps of its own to keep), ``"anchor"`` (not counted, and a
        peer's model or values that may hold the inf) or ``"skip"``."""
        landed = average is not None
        self.averager.settle(committed and landed)
        healed, self._healed = self._healed, False
        if committed and landed:
            return "replace" if healed and flight.start is not None else "apply"
        return "anchor" if healed or not finite else "skip"

    def _apply_outcome(self, flight: _InFlight, outcome: str) -> None:
        if outcome in ("apply", "replace"):
            self._apply(dataclasses.replace(flight, replace=outcome == "replace" or flight.replace), flight.average.buffer)
        elif outcome == "anchor":
            self._to_anchor(flight.fragment)
        else:
            self._skip_sync(flight)

    def _skip_sync(self, flight: _InFlight) -> None:
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

    def _part(self) -> dict[str, Any]:
        """Asks first whether each sync in flight counts, as landing it would (the run goes
        on alike): the saved state holds the outcomes, and a restored run lands them at
        the same steps without asking again."""
        for flight in self._in_flight[len(self._outcomes) :]:
            verdict = self._wait_and_ask(flight.average)
            with self._settling:
                self._outcomes.append(self._outcome_of(flight, *verdict))
        for flight, outcome in zip(self._in_flight, self._outcomes):
            if outcome in ("anchor", "skip"):  # its average is not used (and may have failed): saved as it is
                done: torch.futures.Future = torch.futures.Future()
                done.set_result(flight.average.buffer)
                flight.average = dataclasses.replace(flight.average, future=done)
        return {**super()._part(), "outcomes": list(self._outcomes)}

    def _load_part(self, part: Mapping[str, Any]) -> None:
        super()._load_part(part)
        self._outcomes = [str(outcome) for outcome in part["outcomes"]]


def managed_from_config(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config,
    manager: Any,
    total_steps: int | None = None,
    key: str = "commpress_diloco",
) -> ManagedDiLoCo | ManagedCO2:
    """The trainer of a config's ``[local_sgd]`` table under ``manager``:
    :class:`ManagedDiLoCo` for ``algorithm = "diloco"`` or ``"local_sgd"``,
    :class:`~commpress.local_sgd.managed_co2.ManagedCO2` for ``"co2"``; the top-level
    ``method`` and ``params`` compress the pseudo-gradients; ``key`` names its state with
    the manager. Local SGD is DiLoCo whose outer step is the plain average (outer SGD at lr
    1, no momentum: the anchor becomes the replicas' mean), one fragment, no delay."""
    section = config.section("local_sgd")
    assert section is not None
    common = {"method": config.method, "params": config.params, "average_buffers": section.average_buffers}
    common.update(total_steps=total_steps, key=key)
    if section.algorithm == "co2":
        co2 = {k: section.value(k) for k in ("outer_lr", "outer_momentum", "staleness_penalty")}
        return ManagedCO2(model, optimizer, manager, period_policy(section), clip=section.clip, **co2, **common)
    if section.algorithm == "local_sgd":
        outer = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False, "fragments": 1, "sync_delay": 0}
    else:
        outer = {k: section.value(k) for k in ("outer_lr", "outer_momentum", "nesterov", "fragments", "sync_delay")}
    merge = {"merge": section.merge, "merge_alpha": section.merge_alpha}
    return ManagedDiLoCo(model, optimizer, manager, period_policy(section), **merge, **outer, **common)
