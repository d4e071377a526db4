"""Callbacks on collective futures that the process can exit after.

gloo completes a collective's future on one of its worker threads and runs the future's
Python callbacks there; after a callback has run, that thread takes the GIL again to
release it, and again to release the collective's tensors (torch keeps a tensor's Python
object alive while C++ holds the tensor too). If the main thread has begun tearing the
interpreter down by then (a script that ends right after its last step), taking the GIL
ends the worker thread inside a C++ destructor and the process aborts ("terminate called
without an active exception") after a run that succeeded. So every callback commpress
hands to a collective's future is counted until it is released (after whatever it held:
the reduction, its futures), and at exit, before the interpreter is torn down, the main
thread waits with the GIL released until the count is zero and gloo's worker threads are
idle: at once after a normal run, a few milliseconds on a busy machine, at most
:data:`EXIT_WAIT` seconds where a collective never completes.

The release on gloo's thread may drop the last reference to a backend, and with it to the
process groups it opened (once ``destroy_process_group()`` has let go of them): a group
destroyed on one of its own worker threads joins that thread and the process aborts
("Resource deadlock avoided"). A backend hands its groups to :func:`outlive_worker`, which
keeps them, where they are let go of on another thread, until the main thread hands over
its next callback or exits.
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

#: the name torch gives gloo's worker threads (what runs the callbacks)
_WORKER = "pt_gloo_runloop"


class _Count:
    """The callbacks not released yet, and whether any ever was counted."""

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
        # release what ``fn`` holds first, so the count falls only once that is gone too
        self.fn = None
        with self.count.changed:
            self.count.n -= 1
            self.count.changed.notify_all()


#: what was let go of on a thread other than the main one and is released on the main one
_kept: list[Any] = []
_kept_lock = threading.Lock()


def when_done(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]) -> None:
    """Run ``fn(fut)`` when ``fut`` completes (on the thread that completes it; at once, on
    this thread, if it has), counted until released so that the process does not exit
    under it."""
    if _kept:
        _release_kept()
    fut.add_done_callback(_Counted(fn))


def outlive_worker(*objects: Any) -> None:
    """Called as their last holder lets go of ``objects`` (process groups): on a thread other
    than the main one (gloo's, releasing a callback) keep them until the main thread hands
    over its next callback or exits, so that none is destroyed on its own worker thread."""
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
    """Wait (the GIL released) until every counted callback is released, at most
    ``timeout`` seconds (default :data:`EXIT_WAIT`); whether they all were."""
    count = _Counted.count
    with count.changed:
        return count.changed.wait_for(lambda: count.n == 0, EXIT_WAIT if timeout is None else timeout)


def _workers_busy() -> bool | None:
    """Whether one of gloo's worker threads is running or waiting to run (after a callback
    it releases the collective's tensors); None where ``/proc`` cannot tell."""
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
    """Wait, the GIL released, until gloo's workers have been idle for two looks in a row
    (50 ms where that cannot be seen), at most until ``deadline``; whether they were."""
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
    """Before the interpreter is torn down: wait for every counted callback and for gloo's
    workers to let go of the collectives they ran, then let go of the groups kept for the
    main thread; say so on stderr if the wait timed out."""
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
