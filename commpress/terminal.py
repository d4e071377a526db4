"""Terminal output shared by the commands and the library's reports: plain-text tables and a
progress bar (tqdm's)."""

from __future__ import annotations

import sys
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
    """tqdm's bar, driven by the count done so far; on a pipe (logs, CI) it redraws at most every
    ``PIPE_SECONDS``, so a long run shows it is alive without filling the log."""

    PIPE_SECONDS = 30.0

    def __init__(self, total: int, label: str = "") -> None:
        from tqdm import tqdm  # imported here: ``commpress --help`` does not pay for it

        tty = sys.stderr.isatty()
        every = 0.1 if tty else self.PIPE_SECONDS
        self._bar = tqdm(
            total=max(total, 1), desc=label, file=sys.stderr, mininterval=every, maxinterval=max(every, 10.0), ascii=not tty
        )

    def update(self, done: int, note: str = "") -> None:
        self._bar.set_postfix_str(note, refresh=False)
        self._bar.update(done - self._bar.n)
        if done >= self._bar.total:
            self._bar.close()
