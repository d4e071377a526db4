"""CO2 under a torchft ``Manager``: the one-round-stale average, through the manager, that
survives a lost replica group.

Every sync is one manager step that spans a round: at the end of round t the replica
applies what landed of round t-1's sync, restarts from the anchor, asks for a quorum and
starts averaging round t's pseudo-gradient; at the end of round t+1 it waits for that
average and asks ``should_commit()``. Committed: the outer step (the staleness penalty, the
clipped momentum) and the compressor's staged state kept. Not committed (a peer lost, a
failed collective, a non-finite average): the outer step and the staged state are dropped,
so the anchor, the outer momentum and the compressor's state stay as they were; the round's
pseudo-gradient is dropped with it (the local model has restarted from the anchor already),
as torchft's own DiLoCo drops a failed sync's steps.

A (re)joining replica heals at its first sync: it contributes nothing to it, waits for its
average at once (not a round later) and takes a healthy peer's anchor, outer state and
compressor state (:class:`~commpress.local_sgd.manager_syncs.ManagerSyncs`), with the model
and optimizer the user registered; it restarts from that anchor, trains the round its peers
train and applies the sync's average at that round's end, as they do. ``staleness_penalty =
"adaptive"`` is refused: its extra all-reduce would fall between two manager steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from commpress.errors import ConfigError
from commpress.local_sgd.co2 import CO2
from commpress.local_sgd.local_sgd import Average
from commpress.local_sgd.manager_syncs import ManagerSyncs
from commpress.local_sgd.periods import Period

__all__ = ["ManagedCO2"]


class ManagedCO2(ManagerSyncs, CO2):
    """:class:`CO2` whose syncs go through ``manager`` (a ``torchft.Manager``), its shared
    state registered with it under ``key``. ``method`` and ``params`` compress the
    pseudo-gradients; the other arguments are :class:`CO2`'s (a constant staleness penalty)."""

    name = "CO2 under a torchft Manager"
    commits_when_averaged = False  # the manager's should_commit() decides

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        manager: Any,
        period: int | Period | None = None,
        method: str = "none",
        params: Mapping[str, Any] | None = None,
        key: str = "commpress_co2",
        **kwargs: Any,
    ) -> None:
        if kwargs.get("staleness_penalty") == "adaptive":
            raise ConfigError(
                f"{self.name}: staleness_penalty = 'adaptive' is not accepted: its all-reduce would run between two "
                "manager steps; expected a number >= 1"
            )
        averager = self._manager_averager(manager, method, params)
        super().__init__(model, inner_optimizer, period, averager=averager, **kwargs)
        #: the landed average of the sync in flight (None: not landed, or dropped) once waited for
        self._landed: tuple[torch.Tensor | None] | None = None
        self._register(key)

    def start_due(self, final: bool = False) -> None:
        """At the end of a round (``final``: of a round in progress): apply the previous
        sync's average if it counts, restart from the anchor, then this round's sync (a
        quorum, its average started); a healing replica lands it at once."""
        if not (self.clock.in_round if final else self.clock.round_ends):
            return
        send = torch.sub(self.anchor, self.flat.read())
        if self._pending is not None:
            self._apply(send)
        self.flat.write(self.anchor)  # before the quorum: a healing peer reads these values
        self._start_manager_step()
        self._keep_for_replay(self.flat.bucket, send.numel())
        self._pending = Average(self.averager.start(self.flat.bucket(send), False), send, self.clock.rounds)
        if not self.backend.participating:
            self._decide_now()
            self.flat.write(self.anchor)  # the peer's
        self.clock.round_done()

    def _apply(self, local: torch.Tensor) -> None:
        """The outer step from the stale average, scaled by the staleness penalty, if its
        sync counts: asked now, or already (a healing replica at its sync's start, a save)."""
        assert self._pending is not None
        if self._landed is not None:
            (average,), self._landed = self._landed, None
            with self._settling:
                self._step(average)
        else:
            verdict = self._wait_and_ask(self._pending)
            with self._settling:  # the compressor's state and the anchor change together for a reading peer
                self._step(self._keep_or_drop(*verdict))
        self._pending = None

    def _decide_now(self) -> None:
        """Ask now whether the sync in flight counts, and keep its average for the round's end."""
        assert self._pending is not None
        verdict = self._wait_and_ask(self._pending)
        with self._settling:
            self._landed = (self._keep_or_drop(*verdict),)

    def _keep_or_drop(self, average: torch.Tensor | None, finite: bool, committed: bool) -> torch.Tensor | None:
        """Keep or drop the compressor's staged state; the average to apply (None: none;
        a non-finite one is dropped as a failed one: the model restarted from the anchor)."""
        counts = committed and average is not None
        self.averager.settle(counts)
        self._healed = False
        return average if counts else None

    def _step(self, average: torch.Tensor | None) -> None:
        """The outer step from ``average`` divided by the staleness penalty (None: no step)."""
        if average is None:
            return
        penalty = float(self.staleness_penalty)
        self.penalties.append(penalty)
        if penalty != 1.0:
            average.mul_(1.0 / penalty)
        self.outer_step(0, average)

    def _part(self) -> dict[str, Any]:
        """Lands the sync in flight first (as a healing replica does), so the state says
        whether it counts: its average is saved if it does, and applied at the next round's
        end as it would have been."""
        if self._pending is not None and self._landed is None:
            self._decide_now()
        if self._landed is not None and self._landed[0] is None:  # dropped: nothing to apply
            self._pending, self._landed = None, None
        return super()._part()

    def _load_part(self, state: Mapping[str, Any]) -> None:
        super()._load_part(state)
        self._landed = None if self._pending is None else (self._pending.buffer,)
