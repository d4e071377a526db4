"""Callbacks on collective futures that the process can exit after.

gloo completes a collective's future on one of its worker threads and runs the future's
Python callbacks there; once a callback has run, that thread takes the GIL once more to
release it. If the main thread has begun tearing the interpreter down by then (a script
that ends right after its last step), taking the GIL ends the worker thread inside a C++
destructor and the process aborts ("terminate called without an active exception") after
a run that succeeded. So every callback commpress hands to a collective's future is
counted until it is released (after whatever it released in turn: the reduction, its
futures), and at exit, before the interpreter is torn down, the main thread waits for
the count to reach zero: at once after a normal run, a few milliseconds on a busy
machine, at most :data:`EXIT_WAIT` seconds where a collective never completes.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["EXIT_WAIT", "drain", "pending", "when_done"]

#: the longest the process waits at exit for callbacks of collectives still in flight
EXIT_WAIT = 2.0

_count = 0
_changed = threading.Condition()


class _Counted:
    """``fn``, counted from now until this object is released."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[torch.futures.Future], Any]) -> None:
        global _count
        self.fn: Callable[[torch.futures.Future], Any] | None = fn
        with _changed:
            _count += 1

    def __call__(self, fut: torch.futures.Future) -> Any:
        assert self.fn is not None
        return self.fn(fut)

    def __del__(self) -> None:
        global _count
        self.fn = None  # what the callback holds goes now, while this thread has the GIL
        with _changed:
            _count -= 1
            _changed.notify_all()


def when_done(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]) -> None:
    """Run ``fn(fut)`` when ``fut`` completes (on the thread that completes it), counted
    until released so that the process does not exit under it."""
    fut.add_done_callback(_Counted(fn))


def pending() -> int:
    """How many callbacks handed to :func:`when_done` are not released yet."""
    with _changed:
        return _count


def drain(timeout: float = EXIT_WAIT) -> bool:
    """Wait (the GIL released) until every counted callback is released, at most
    ``timeout`` seconds; whether they all were."""
    with _changed:
        return _changed.wait_for(lambda: _count == 0, timeout)


atexit.register(drain)
