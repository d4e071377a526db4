"""Local SGD, and the syncs that start at a round's end and land some steps later, fragment by
fragment, on which :class:`~commpress.local_sgd.DiLoCo` builds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from commpress.local_sgd.average import Average, InFlight
from commpress.local_sgd.fragments import Fragment, split
from commpress.local_sgd.trainer import Trainer

__all__ = ["LocalSGD"]


class LocalSGD(Trainer):
    """Local SGD: at every round's end the whole model's pseudo-gradient is averaged and lands at
    once, the outer SGD (lr 1, no momentum) making the anchor the average and the local model
    taking it. The arguments are :class:`Trainer`'s."""

    #: Streaming DiLoCo's settings, fixed: the whole model syncs and lands at once, into the anchor
    fragment_count = 1
    sync_delay = 0
    merge = "mix"
    merge_alpha = 0.0

    def _no_syncs(self) -> None:
        #: per fragment, the step count at which its local values last equalled the anchor
        self.fresh = [0] * len(self.fragments)
        self._in_flight: list[InFlight] = []
        #: per sync in flight, oldest first, how it lands, when that was asked at a save
        self._outcomes: list[str] = []

    def _outer_params(self) -> list[torch.Tensor]:
        """The anchor of each fragment, cut here, where the flat model is first known."""
        self.fragments = split(self.flat.slots, self.fragment_count, self.name, self.flat.whole_numel)
        return [self.anchor[f.where] for f in self.fragments]

    def start_due(self, final: bool = False) -> None:
        """At a round's end: land what is in flight, then start fragment ``syncs % fragments``.
        ``final``: land it all, then sync every fragment changed since its last sync (under a torchft
        Manager every fragment, each landing at once: replicas cannot know what their peers changed)."""
        if not (final or self.clock.round_ends):
            return
        self._apply_syncs_due(until=None)
        if not final:
            self._begin_sync()
            self._start_fragment(self.fragments[self.syncs % len(self.fragments)], self.clock.step + self.sync_delay)
            return
        fixed = self.backend.fixed_members
        for fragment in self.fragments:
            if fixed and self.fresh[fragment.index] == self.clock.step:
                continue
            self._begin_sync()
            self._start_fragment(fragment, self.clock.step, replace=True)
            if not fixed:
                self._apply_syncs_due(until=None)

    def apply_due(self, final: bool = False) -> None:
        """Land the averages due by this step (``final``: all), then end the round if it ended."""
        self._apply_syncs_due(until=None if final else self.clock.step)
        if self.clock.round_ends or (final and self.clock.in_round):  # final: if steps were taken in it
            self.clock.round_done()

    def _apply_syncs_due(self, until: int | None) -> None:
        """Land, in the order they started, the averages due by step ``until`` (None: all)."""
        while self._in_flight and (until is None or self._in_flight[0].due <= until):
            self._land_one(self._in_flight.pop(0))

    def _start_fragment(self, fragment: Fragment, due: int, replace: bool = False) -> None:
        """Start averaging ``fragment``'s pseudo-gradient, landing at step ``due``."""
        anchor, local = self.anchor[fragment.where], self.flat.read(tensors=fragment.tensors)
        start = None if replace or due == self.clock.step else self._eager_move(fragment, anchor, local)
        started = self._start_average(torch.sub(anchor, local, out=local), fragment.bucket)  # local: the pseudo-gradient
        if start is not None:
            self.flat.write(start, fragment.tensors)
        self._in_flight.append(InFlight(started, fragment, due, replace, start))

    def _eager_move(self, fragment: Fragment, anchor: torch.Tensor, local: torch.Tensor) -> torch.Tensor | None:
        """Where a delayed sync moves the local values when it starts (None: nowhere)."""
        return None

    def _land_one(self, flight: InFlight) -> None:
        """Land a sync: the outer step with the averaged pseudo-gradient, then the merge of the local
        values (or they take the anchor's), or :meth:`_skip_sync` if it does not count."""
        verdict = None if self._outcomes else self.transaction.ask(lambda: self._wait(flight.average))
        with self.transaction.lock:  # the compressor's state and the anchor change together for a reading peer
            outcome = self._outcomes.pop(0) if verdict is None else self._outcome_of(flight, *verdict)
            if outcome in ("apply", "replace"):
                self.outer_step(flight.fragment.index, flight.average.buffer)
                if outcome == "replace" or flight.replace or (flight.start is None and self.merge_alpha == 0):
                    self._to_anchor(flight.fragment)
                else:
                    self._merge(flight)
            elif outcome == "anchor":
                self._to_anchor(flight.fragment)
            else:
                self._skip_sync(flight)

    def _outcome_of(self, flight: InFlight, average: torch.Tensor | None, finite: bool, committed: bool) -> str:
        """Settle the compressor's staged state; how the sync lands: ``"apply"``, ``"replace"``
        (a healed replica has no steps of its own to keep: the local values take the anchor's),
        ``"anchor"`` (not counted, and a peer's model or values that may hold the inf) or ``"skip"``."""
        landed = average is not None
        healed = self.transaction.settle(committed and landed)
        if committed and landed:
            return "replace" if healed and flight.start is not None else "apply"
        return "anchor" if healed or not finite else "skip"

    def _merge(self, flight: InFlight) -> None:
        """The local values after a landed average, where they do not take the anchor's."""
        self._to_anchor(flight.fragment)

    def _skip_sync(self, flight: InFlight) -> None:
        """A sync that does not count keeps the fragment's local steps: the next sync sends them."""

    def _to_anchor(self, fragment: Fragment) -> None:
        """The fragment's local values become its anchor's."""
        self.flat.write(self.anchor[fragment.where], fragment.tensors)
        self.fresh[fragment.index] = self.clock.step

    def _syncs_part(self) -> dict[str, Any]:
        """Each fragment's last sync step and the syncs in flight with their outcomes, so a restored
        run lands the same values at the same steps without asking again."""
        for flight in self._in_flight[len(self._outcomes) :]:
            verdict = self.transaction.ask(lambda f=flight: self._wait(f.average))
            with self.transaction.lock:
                self._outcomes.append(self._outcome_of(flight, *verdict))
        in_flight = []
        for flight, outcome in zip(self._in_flight, self._outcomes):
            if outcome in ("anchor", "skip"):  # its average is not used (and may have failed): saved as it is
                flight.average = Average.landed(flight.average.buffer, flight.average.round)
            saved = {"fragment": flight.fragment.index, "due": flight.due, "round": flight.average.round}
            copies = {"average": flight.average.buffer.clone(), "start": None if flight.start is None else flight.start.clone()}
            in_flight.append({**saved, **copies, "replace": flight.replace})
        return {"fresh": list(self.fresh), "in_flight": in_flight, "outcomes": list(self._outcomes)}

    def _load_syncs(self, part: Mapping[str, Any]) -> None:
        self.fresh = [int(step) for step in part["fresh"]]
        self._outcomes = [str(outcome) for outcome in part["outcomes"]]
        self._in_flight = []
        for saved in part["in_flight"]:
            average = Average.landed(saved["average"].clone(), int(saved["round"]))
            start = None if saved["start"] is None else saved["start"].clone()
            fragment = self.fragments[saved["fragment"]]
            self._in_flight.append(InFlight(average, fragment, int(saved["due"]), saved["replace"], start))
