"""Callbacks on collective futures are counted until released, and the process waits for
them at exit (comm/callbacks.py): a worker thread that still has to release one when the
interpreter is torn down aborts the process. Each check runs in a fresh interpreter: the
count is the process's, and other tests' collectives would move it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(body: str) -> list[str]:
    script = "import threading, time, torch\nfrom commpress.comm import callbacks\n" + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_callback_is_counted_until_released():
    out = _run(
        """
        ran = []
        fut = torch.futures.Future()
        callbacks.when_done(fut, lambda f: ran.append(f.value()))
        print(callbacks.pending())
        fut.set_result(7)
        print(ran[0], callbacks.pending(), callbacks.drain(timeout=0.0))
        """
    )
    assert out == ["1", "7", "0", "True"]


def test_drain_waits_for_a_callback_run_on_another_thread_and_is_bounded():
    out = _run(
        """
        ran = []
        fut = torch.futures.Future()

        def body(f):
            time.sleep(0.2)
            ran.append(f.value())

        callbacks.when_done(fut, body)
        threading.Thread(target=fut.set_result, args=(1,)).start()
        t0 = time.perf_counter()
        print(callbacks.drain(timeout=10.0), ran, time.perf_counter() - t0 >= 0.15)
        never = torch.futures.Future()
        callbacks.when_done(never, lambda f: None)
        print(callbacks.drain(timeout=0.05))
        never.set_result(None)  # (a future holds its callbacks until it completes)
        print(callbacks.drain(timeout=1.0))
        """
    )
    assert out == ["True", "[1]", "True", "False", "True"]


def test_process_exits_cleanly_while_gloo_runs_a_callback():
    """A gloo worker thread is still in a callback when the script ends (the process groups
    left alive, as at the end of many scripts): the process waits for it and exits with 0.
    Handed to the future with ``then`` instead, the same script dies at exit (SIGSEGV or
    SIGABRT): the worker takes the GIL back while the interpreter is torn down. Two ranks
    of one process, so that the collective is still open when the callback is handed over
    and completes on gloo's thread once the second rank joins it."""
    out = _run(
        """
        from datetime import timedelta
        import torch.distributed as dist
        store, groups = dist.HashStore(), [None, None]

        def connect(rank):
            groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))

        joining = [threading.Thread(target=connect, args=(r,)) for r in range(2)]
        [t.start() for t in joining]
        [t.join() for t in joining]
        started, ended = threading.Event(), threading.Event()

        def body(f):
            started.set()
            ended.wait()  # the main thread ends the script meanwhile
            print("released", f.value()[0].tolist(), flush=True)

        fut = groups[0].allreduce([torch.ones(2)]).get_future()
        print(fut.done())  # rank 1 has not joined the all-reduce yet
        callbacks.when_done(fut, body)
        groups[1].allreduce([torch.ones(2)])
        started.wait()
        print("ends", flush=True)
        ended.set()
        """
    )
    assert out == ["False", "ends", "released", "[2.0,", "2.0]"]


def test_the_count_outlasts_torchft_callbacks_on_a_collective():
    """Under a torchft Manager the collective's future is wrapped by torchft's timeout,
    whose callback completes the wrapped future and then goes on (a stand-in here): the
    count reaches zero only once that callback has ended too."""
    pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")
    out = _run(
        """
        from commpress.comm.manager_backend import ManagerBackend
        from commpress.compressors import AllReduce
        import torchft.futures
        after, checked = [], threading.Event()

        class Group:
            def size(self):
                return 2

            def allreduce(self, tensors, opts):
                fut = torch.futures.Future()
                threading.Timer(0.1, fut.set_result, args=(tensors,)).start()  # gloo's thread
                return type("Work", (), {"get_future": lambda _: fut})()

        class Manager:
            _pg = Group()
            _timeout = None

            def current_step(self):
                return 0

            def num_participants(self):
                return 2

            def is_participating(self):
                return True

            def participating_rank(self):
                return 0

            def errored(self):
                return None

        def timed(fut, timeout):  # torchft's timeout wrapper, going on after it completed the future
            out = torch.futures.Future()

            def forward(f):
                out.set_result(f.value())
                checked.wait()
                after.append("torchft's callback ended")

            fut.add_done_callback(forward)
            return out

        torchft.futures.future_timeout = timed

        def once(request):
            return (yield request)

        backend = ManagerBackend(Manager(), rounds=1)
        backend.begin_step()
        backend.run(once(AllReduce(torch.ones(2)))).wait()
        empty = after == []
        checked.set()
        print(empty, callbacks.drain(timeout=60.0), after == ["torchft's callback ended"])
        """
    )
    assert out == ["True", "True", "True"]


def test_a_forked_child_starts_with_no_count():
    """A child forked while a collective's callback is pending runs none of its parent's
    collectives: it must not wait for them at its exit."""
    out = _run(
        """
        import os
        fut = torch.futures.Future()
        callbacks.when_done(fut, lambda f: None)
        pid = os.fork()
        if pid == 0:
            print("child", callbacks.pending(), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", callbacks.pending(), flush=True)
        fut.set_result(None)
        """
    )
    assert out == ["child", "0", "parent", "1"]


def test_a_backend_released_on_gloos_thread_leaves_its_groups_to_the_main_thread(tmp_path):
    """The main thread lets go of a torch backend and takes the process group down while
    gloo's worker thread still runs the backend's callback: the worker then holds the last
    reference to the backend and its channel groups. A group destroyed on its own worker
    thread joins that thread and the process aborts ("Resource deadlock avoided"); the
    groups are left to the main thread instead, and the script ends with 0. Two ranks, so
    that rank 0's all-reduce completes on gloo's thread: rank 1 joins it only once rank 0
    has handed its callback over (a key in their store)."""
    script = textwrap.dedent(
        """
        import gc, sys, threading, torch
        import torch.distributed as dist
        from commpress.comm import callbacks
        from commpress.comm.torch_backend import TorchBackend
        from commpress.compressors import AllReduce
        rank = int(sys.argv[1])
        store = dist.FileStore(sys.argv[2], 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        backend = TorchBackend(rounds=1)

        def plain(request):
            return (yield request)

        if rank == 1:
            store.wait(["handed over"])
            backend.run(plain(AllReduce(torch.ones(2)))).wait()
            sys.exit(0)
        resumed, release = threading.Event(), threading.Event()

        def once(request):
            result = yield request
            resumed.set()
            print("on gloo's thread:", threading.current_thread() is not threading.main_thread(), flush=True)
            release.wait()
            return result

        fut = backend.run(once(AllReduce(torch.ones(2))))
        store.set("handed over", "1")
        resumed.wait()
        del backend
        dist.destroy_process_group()
        gc.collect()
        release.set()
        fut.wait()
        print(callbacks.drain(timeout=60.0), fut.value() is not None, flush=True)
        """
    )
    store = str(tmp_path / "store")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), store], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    outs = [r.communicate(timeout=120) for r in ranks]
    assert [r.returncode for r in ranks] == [0, 0], [err for _, err in outs]
    assert outs[0][0].split() == ["on", "gloo's", "thread:", "True", "True", "True"]
