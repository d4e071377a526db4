"""Terminal output shared by the commands and the library's reports: plain-text tables and a
one-line progress display."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

__all__ = ["Progress", "format_table"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to width; numbers right-aligned, text left-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("x%*").replace(",", ""))
    except ValueError:
        return text in ("-", "")
    return True


class Progress:
    """``Progress(total, label).update(done)`` redraws ``label [#####.....] done/total``.
    On a pipe (logs, CI) it writes a line every ``PIPE_SECONDS`` and the finished line, so
    a long run still shows it is alive."""

    PIPE_SECONDS = 30.0

    def __init__(self, total: int, label: str = "", width: int = 30) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.start = self._shown = time.perf_counter()
        self._tty = sys.stderr.isatty()

    def update(self, done: int, note: str = "") -> None:
        if not self._tty and done < self.total:
            if time.perf_counter() - self._shown < self.PIPE_SECONDS:
                return
            self._shown = time.perf_counter()
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{self.label} [{bar}] {done}/{self.total} {time.perf_counter() - self.start:5.1f}s {note}"
        end = "\n" if done >= self.total or not self._tty else ""
        sys.stderr.write(("\r" if self._tty else "") + line + end)
        sys.stderr.flush()
