"""Start N ranks on this machine, each a process joined by torch.distributed (gloo on CPU).

Used by ``commpress demo``, ``commpress bench --local N`` and the multi-rank tests. The ranks
run on torch's elastic launcher (``torchrun``'s engine, :func:`elastic_launch`): it hosts the
rendezvous store, starts the processes, ends the others when one fails and reports each
failed rank's exit code and traceback as torchrun does (a ``ChildFailedError``). What it has
no word for is a deadline on the whole run: each rank arms one itself (``faulthandler``),
see docs/architecture.md, "Launching local ranks".
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from commpress.kernels.cpu.openmp import rank_env

__all__ = ["run_local"]


def _entry(fn: Callable[..., Any], backend: str, threads: int, timeout: float, args: tuple[Any, ...]) -> bytes:
    """One rank: join the group the launcher's variables describe, run ``fn``, leave.

    A rank still running after ``timeout`` seconds prints every thread's stack and exits
    with status 1; the launcher then ends the other ranks and reports it."""
    import torch
    import torch.distributed as dist

    faulthandler.dump_traceback_later(timeout, exit=True)
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    try:
        out = fn(dist.get_rank(), dist.get_world_size(), *args)
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
    return pickle.dumps(out)  # plain bytes: no shared memory to outlive the rank


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 600.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes with an
    initialized default process group; return their results in rank order.

    ``fn`` must be importable (a module-level function). A failing rank, or one still
    running after ``timeout`` seconds, raises torch's ``ChildFailedError`` naming the rank,
    its exit code and its traceback. The ranks start with ``GOMP_SPINCOUNT=10000`` unless
    the environment chooses how OpenMP workers wait (:mod:`commpress.kernels.cpu.openmp`).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",  # as ``torchrun --standalone``: the store lives in this process
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=0,
        start_method="spawn",
    )
    threads = max(1, (os.cpu_count() or 1) // world_size)
    with _environment(rank_env()):
        out = elastic_launch(config, _entry)(fn, backend, threads, timeout, args)
    return [pickle.loads(out[r]) for r in range(world_size)]


@contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` added to the environment the ranks inherit (spawned children copy it at
    start); ours is restored afterwards."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
