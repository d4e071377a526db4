"""The commands' progress bar."""

from __future__ import annotations

import sys

__all__ = ["Progress"]


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
