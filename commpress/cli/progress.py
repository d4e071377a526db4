"""A one-line progress display on stderr (redrawn in place on a terminal)."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """``Progress(total, label).update(done)`` redraws ``label [#####.....] done/total``."""

    def __init__(self, total: int, label: str = "", width: int = 30) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.start = time.perf_counter()
        self._tty = sys.stderr.isatty()

    def update(self, done: int, note: str = "") -> None:
        if not self._tty and done < self.total:
            return  # on a pipe (logs, CI), only the finished line
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{self.label} [{bar}] {done}/{self.total} {time.perf_counter() - self.start:5.1f}s {note}"
        end = "\n" if done >= self.total or not self._tty else ""
        sys.stderr.write(("\r" if self._tty else "") + line + end)
        sys.stderr.flush()
