"""Counters of what a rank sent and how long it spent compressing (:class:`Traffic`).

What was measured, as opposed to :mod:`commpress.bandwidth.traffic`, the model that predicts it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["Traffic"]


@dataclass
class Traffic:
    """Cumulative per-rank counters, safe to update from communication threads.

    ``bytes_sent`` counts the payload this rank contributes to collectives (its input
    tensor's bytes; the sizes exchanged before a variable all-gather included), not the
    algorithm-dependent bytes a ring or tree forwards. ``compute_seconds`` is the time
    spent inside compressor code (compress and decompress) between collectives.
    """

    bytes_sent: int = 0
    collectives: int = 0
    compute_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int = 0, collectives: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            self.bytes_sent += nbytes
            self.collectives += collectives
            self.compute_seconds += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {
                "bytes_sent": self.bytes_sent,
                "collectives": self.collectives,
                "compute_seconds": self.compute_seconds,
            }

    def __getstate__(self) -> dict[str, float]:
        return self.snapshot()  # the counts travel, the lock is this process's

    def __setstate__(self, counts: dict[str, float]) -> None:
        self.__init__(**counts)

    def reset(self) -> None:
        with self._lock:
            self.bytes_sent = 0
            self.collectives = 0
            self.compute_seconds = 0.0
