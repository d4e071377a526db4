"""What a rank sent and how long it spent compressing, as measured (:mod:`commpress.bandwidth.traffic` predicts it)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["Traffic"]


@dataclass
class Traffic:
    """Cumulative per-rank counters, safe to update from communication threads: ``bytes_sent`` is
    this rank's input to collectives (not what a ring forwards), ``compute_seconds`` the time in
    compressor code."""

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
            return {"bytes_sent": self.bytes_sent, "collectives": self.collectives, "compute_seconds": self.compute_seconds}

    def __getstate__(self) -> dict[str, float]:
        return self.snapshot()  # the counts travel, the lock is this process's

    def __setstate__(self, counts: dict[str, float]) -> None:
        self.__init__(**counts)

    def reset(self) -> None:
        with self._lock:
            self.bytes_sent, self.collectives, self.compute_seconds = 0, 0, 0.0
