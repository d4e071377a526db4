"""Callbacks on collective futures that the process can exit after.

gloo runs a future's Python callbacks on its worker thread, which retakes the GIL to release
the callback and the collective's tensors; during interpreter teardown that aborts the process
("terminate called without an active exception") after a successful run. So every callback
commpress hands a future is counted until released, and at exit the main thread waits (GIL
released, at most :data:`EXIT_WAIT` seconds) for the count to reach zero and gloo to idle.
A process group destroyed on its own worker thread also aborts ("Resource deadlock avoided"):
:func:`outlive_worker` keeps such groups for the main thread to let go of.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["EXIT_WAIT", "drain", "outlive_worker", "pending", "when_done"]

#: the longest the process waits at exit for callbacks of collectives still in flight
EXIT_WAIT = 2.0

#: the name torch gives gloo's worker threads
_WORKER = "pt_gloo_runloop"


class _Count:
    def __init__(self) -> None:
        self.n = 0
        self.ever = False
        self.changed = threading.Condition()


class _Counted:
    """``fn``, counted from now until this object is released."""

    __slots__ = ("fn",)
    count = _Count()  # a class attribute: still there if a late release runs during teardown

    def __init__(self, fn: Callable[[torch.futures.Future], Any]) -> None:
        self.fn: Callable[[torch.futures.Future], Any] | None = fn
        with self.count.changed:
            self.count.n += 1
            self.count.ever = True

    def __call__(self, fut: torch.futures.Future) -> Any:
        assert self.fn is not None
        return self.fn(fut)

    def __del__(self) -> None:
        # release what ``fn`` holds first: the count falls only once that is gone
        self.fn = None
        with self.count.changed:
            self.count.n -= 1
            self.count.changed.notify_all()


#: what was let go of on a thread other than the main one and is released on the main one
_kept: list[Any] = []
_kept_lock = threading.Lock()


def when_done(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]) -> None:
    """Run ``fn(fut)`` when ``fut`` completes, counted until released."""
    if _kept:
        _release_kept()
    fut.add_done_callback(_Counted(fn))


def outlive_worker(*objects: Any) -> None:
    """Called as the last holder lets go of ``objects`` (process groups): off the main thread,
    keep them until the main thread's next :func:`when_done` or exit."""
    if threading.current_thread() is not threading.main_thread():
        with _kept_lock:
            _kept.extend(objects)


def _release_kept() -> None:
    """On the main thread: let go of what :func:`outlive_worker` kept."""
    if threading.current_thread() is threading.main_thread():
        with _kept_lock:
            kept = _kept[:]
            _kept.clear()
        del kept  # outside the lock: a group's destructor waits for its work to end


def pending() -> int:
    """How many callbacks handed to :func:`when_done` are not released yet."""
    with _Counted.count.changed:
        return _Counted.count.n


def drain(timeout: float | None = None) -> bool:
    """Wait, GIL released, at most ``timeout`` (default :data:`EXIT_WAIT`) seconds until every
    counted callback is released; whether they all were."""
    count = _Counted.count
    with count.changed:
        return count.changed.wait_for(lambda: count.n == 0, EXIT_WAIT if timeout is None else timeout)


def _workers_busy() -> bool | None:
    """Whether a gloo worker thread is running or runnable; None where ``/proc`` cannot tell."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread has ended
        head, _, tail = stat.rpartition(")")  # "tid (name) state ..."
        if head.partition("(")[2] == _WORKER and tail[1:2] in ("R", "D"):
            return True
    return False


def _wait_until_idle(deadline: float) -> bool:
    """Wait until gloo's workers look idle twice in a row, at most until ``deadline``; whether they did."""
    idle = 0
    while idle < 2:
        busy = _workers_busy()
        if busy is None:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            return True
        idle = 0 if busy else idle + 1
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def _at_exit() -> None:
    """Wait for the counted callbacks and idle workers, then release the kept groups."""
    if not _Counted.count.ever:
        return
    deadline = time.monotonic() + EXIT_WAIT
    if not drain() or not _wait_until_idle(deadline):
        print(
            f"commpress: exiting before gloo's collectives finished ({pending()} callbacks pending after {EXIT_WAIT} s)",
            file=sys.stderr,
        )
        return
    _release_kept()


def _reset_in_child() -> None:
    """A forked child runs none of its parent's collectives: it starts with no count."""
    _Counted.count = _Count()


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_reset_in_child)
