"""Start N ranks on this machine, each a process joined by torch.distributed (gloo on CPU).

Used by ``commpress demo``, ``commpress bench --local N`` and the multi-rank tests.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commpress.kernels.cpu.openmp import rank_env

__all__ = ["RankFailed", "run_local"]


class RankFailed(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    try:
        torch.set_num_threads(threads)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(out)))  # plain bytes: no shared memory to outlive us
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 600.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes with an
    initialized default process group; return their results in rank order.

    ``fn`` must be importable (a module-level function). Raises :class:`RankFailed` with
    the first failing rank's traceback, or on timeout. The ranks start with
    ``GOMP_SPINCOUNT=10000`` unless the environment chooses how OpenMP workers wait
    (:mod:`commpress.kernels.cpu.openmp`).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_entry, args=(r, fn, world_size, store.port, backend, threads, args, results), daemon=True)
        for r in range(world_size)
    ]
    _start(procs, rank_env())
    out: dict[int, Any] = {}
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(out) < world_size:
            if not _wait_for(results, deadline, procs, out):
                raise RankFailed(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish within {timeout:.0f} s")
            rank, ok, value = results.get()
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        del store
    return [out[r] for r in range(world_size)]


def _start(procs: list[Any], env: dict[str, str]) -> None:
    """Start ``procs`` with ``env`` added to the environment they inherit (spawned children
    copy it at start; ours is restored afterwards)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _wait_for(results: Any, deadline: datetime.datetime, procs: list[Any], out: dict[int, Any]) -> bool:
    """Wait until a result is queued; False on timeout. Raises when a rank died without one."""
    while datetime.datetime.now() < deadline:
        if not results.empty():
            return True
        dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None) and i not in out]
        if dead and results.empty():
            time.sleep(0.5)
            if results.empty():
                raise RankFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result")
        time.sleep(0.02)
    return False
