"""A Local SGD trainer's sync as one step of its backend's transaction
(:class:`~commpress.comm.backend.Backend`): open the step, keep what a replay needs, ask at the
landing whether it counts. Under a torchft ``Manager`` the compressors' step is the manager's
(so replicas that joined at different times use the same seeds), a failed or non-finite sync
does not count, and a (re)joining replica takes a healthy peer's state in ``should_commit()``,
replays the reductions in flight on it and takes its peer's step count (:func:`peer_clock`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from commpress.comm.averager import ParameterAverager
from commpress.comm.manager_backend import replay
from commpress.compressors import Context
from commpress.local_sgd.rounds import RoundClock

__all__ = ["SyncTransaction", "Verdict", "peer_clock"]

log = logging.getLogger("commpress.manager")

#: what a replayed sync needs: the bucket its values go in, their count, its context
Replay = tuple[Callable[[torch.Tensor], Any], int, Context]
#: how a sync ends: the averaged values (None: failed or not finite), whether they are finite, whether it counts
Verdict = tuple[torch.Tensor | None, bool, bool]


class SyncTransaction:
    """The syncs of the trainer called ``name``, averaging through ``averager``."""

    def __init__(self, averager: ParameterAverager, name: str) -> None:
        self.averager = averager
        self.backend = averager.backend
        self.name = name
        #: whether each sync counted, in order
        self.commits: list[bool] = []
        #: set when a peer's shared state is loaded, until the sync it healed in lands
        self.healed = False
        #: the most participants of any sync so far
        self.most = 0
        #: held while the shared state changes: a healing peer reads it from the manager's quorum thread
        self.lock = threading.RLock()
        self._replays: list[Replay] = []  # per average in flight: what a replay needs
        self._at_quorum: dict[str, Any] | None = None  # the clock when the last sync began
        self._past_end = False  # warned that a sync began past total_steps

    def begin(self, clock: RoundClock) -> None:
        """A sync begins: a peer may read the shared state and the step opens; a replica syncing
        past the job's end under a manager is warned once."""
        self.backend.allow_state_reads(True)
        self._at_quorum = clock.state_dict()
        self.backend.open_step()
        self.most = max(self.most, self.backend.world_size)
        total = clock.total_steps
        if not self.backend.fixed_members and total is not None and clock.step > total and not self._past_end:
            self._past_end = True
            log.warning(
                "%s: a sync at step %d, past total_steps = %d: this replica trains past the job's end (its model will "
                "not be its peers'); end the loop at the job's step (while reg.local_sgd.job_step < total_steps)",
                self.name,
                clock.step,
                total,
            )

    def keep_for_replay(self, bucket: Callable[[torch.Tensor], Any], numel: int) -> None:
        """A sync of ``numel`` values in ``bucket`` starts: it takes the backend's step, its replay is kept."""
        self.averager.calls = self.backend.step_of(self.averager.calls)
        self._replays.append((bucket, numel, self.averager.next_context()))

    def ask(self, wait: Callable[[], torch.Tensor]) -> Verdict:
        """Wait for the oldest sync's checked average (``wait``) and end its step; a failure the
        backend does not survive drops the staged compressor state and is raised."""
        self._replays.pop(0)
        values: torch.Tensor | None = None
        finite = True
        try:
            values = wait()
        except Exception as exc:  # a failed collective or a non-finite average
            if not self.backend.survived(exc):
                self.averager.settle(False)
                raise
            finite = not isinstance(exc, FloatingPointError)
        committed = self.backend.commit()
        self.commits.append(committed)
        return values, finite, committed

    def settle(self, counts: bool) -> bool:
        """Keep (``counts``) or drop the staged compressor state; whether the sync healed this replica."""
        self.averager.settle(counts)
        healed, self.healed = self.healed, False
        return healed

    def replay(self, dtype: torch.dtype, device: torch.device) -> None:
        """Run the reductions in flight, input zeros, on the results the backend recorded while
        this replica heals and on the compressor state just loaded, staging what its peers staged."""
        for (bucket, numel, ctx), results in zip(self._replays, self.backend.log or []):
            zeros = torch.zeros(numel, dtype=dtype, device=device)
            replay(self.averager.groups.composite.reduce(bucket(zeros), ctx), results)

    def forget_replays(self) -> None:
        """A loaded state says how its syncs in flight land: nothing is left to replay."""
        self._replays = []

    def took_clock(self, clock: RoundClock, peer: Mapping[str, Any]) -> None:
        """Load into ``clock`` the step count a healing replica takes from ``peer``'s clock."""
        clock.load_state_dict(peer_clock(self._at_quorum, clock.state_dict(), peer))

    def warn_if_fewer(self, step: int) -> None:
        """At finish: warn if the last sync had fewer participants than this replica has synced with."""
        last = self.backend.world_size
        if last < self.most:
            log.warning(
                "%s: finish() at step %d synced with %d replica group(s), fewer than the %d this replica has synced "
                "with: either a group was lost before the end, or the groups stopped at different steps and this one "
                "trained on without them (its model is then not theirs); end every replica at the job's step "
                "(while reg.local_sgd.job_step < total_steps), which a restarted replica takes from its peers",
                self.name,
                step,
                last,
                self.most,
            )


def peer_clock(at: Mapping[str, Any] | None, now: Mapping[str, Any], peer: Mapping[str, Any]) -> dict[str, Any]:
    """The step count a healing replica takes: ``peer``'s, read at the quorum, plus what this
    replica's clock did between ``at`` (its clock at the quorum) and ``now`` (a delayed sync heals
    when it lands, ``sync_delay`` steps later); healing at the quorum's own step, the peer's."""
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
