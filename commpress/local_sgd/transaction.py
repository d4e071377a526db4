"""A Local SGD trainer's sync as one step of its backend's transaction
(:class:`~commpress.comm.backend.Backend`): it opens the step, keeps what a replay of the
step's reduction needs, asks at the landing whether the step counts, and gives a healing
replica its peer's step count.

On a fixed process group every step counts and a failure is raised. Under a torchft
``Manager`` (:class:`~commpress.comm.manager_backend.ManagerBackend`) opening a step asks
for a quorum; the compressors' step is the manager's (so replicas that joined at different
times use the same seeds); a failed collective or a non-finite average makes the step not
count (``should_commit()`` is False) and the run goes on; a (re)joining replica receives a
healthy peer's shared state in ``should_commit()``, replays the reductions in flight on it
(:meth:`SyncTransaction.replay`) and takes its peer's step count (:func:`peer_clock`), so a
loop driven by the job's step ends every replica at the same step.
"""

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
        """A sync begins: a peer may read the shared state, the step opens (a quorum under a
        manager); a replica syncing past the job's end under a manager is warned once."""
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
        """A sync of ``numel`` values put in ``bucket`` starts: its compressors' step is the
        backend's, and what a replay of it needs is kept until it lands."""
        self.averager.calls = self.backend.step_of(self.averager.calls)
        self._replays.append((bucket, numel, self.averager.next_context()))

    def ask(self, wait: Callable[[], torch.Tensor]) -> Verdict:
        """Wait for the oldest sync in flight (``wait`` gives its checked average) and end its
        step. A failure the backend does not survive drops the staged compressor state and
        is raised."""
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
        """Keep the staged compressor state if the sync ``counts``, else drop it; whether the
        sync healed this replica (cleared)."""
        self.averager.settle(counts)
        healed, self.healed = self.healed, False
        return healed

    def replay(self, dtype: torch.dtype, device: torch.device) -> None:
        """Run the reductions in flight on the results the backend recorded while this
        replica heals (its input zeros), on the compressor state just loaded: it then stages
        what its peers staged."""
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
        """At finish: a WARNING if the last sync had fewer participants than this replica
        has synced with (a replica group lost before the end, or stopped at another step)."""
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
    """The step count a healing replica takes: ``peer``'s, read when the peer answered the
    quorum, plus what this replica's clock did between ``at`` (its clock at its quorum) and
    ``now`` (a delayed sync heals when it lands, ``sync_delay`` steps later: those steps, the
    round ended and the one begun). Healing in the quorum's own step, it is the peer's as it
    is (QSR's rounds too)."""
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
