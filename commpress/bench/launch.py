"""Start N ranks on this machine, each a process joined by torch.distributed (gloo on CPU).

Used by ``commpress demo``, ``commpress bench --local N`` and the multi-rank tests. The ranks
run on torch's elastic launcher (``torchrun``'s engine, :func:`elastic_launch`): it hosts the
rendezvous store, starts the processes, ends the others when one fails and reports each
failed rank's exit code and traceback as torchrun does (a ``ChildFailedError``). What it has
no word for is a deadline on the whole run: each rank arms one itself (``faulthandler``),
see docs/architecture.md, "Launching local ranks".

Ranks fork from multiprocessing's fork server, which imports torch and commpress once per
launching process, instead of each spawned rank importing them again (4 to 6 s a launch on
a 2-core machine, 0.4 s forked). The server keeps the environment and the standard streams
it started with, so each rank takes the launcher's back before it runs, and a launch whose
variables read at import time (:data:`IMPORT_TIME_VARIABLES`) differ from the server's is
spawned.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

from commpress.kernels.cpu.openmp import rank_env

__all__ = ["IMPORT_TIME_VARIABLES", "run_local"]

#: What the fork server imports once: torch's distributed and FSDP modules (FSDP alone costs
#: about 1.5 s) and commpress's entry point.
PRELOAD = ("torch.distributed.fsdp", "commpress.registration")
#: Prefixes of the variables that libraries read when they load (OpenMP, MKL, torch's CPU
#: capability, CUDA, Python's own): a forked rank cannot take these back, so a launch whose
#: values differ from the fork server's is spawned.
IMPORT_TIME_VARIABLES = (
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "ATEN_",
    "ONEDNN_",
    "DNNL_",
    "OPENBLAS_",
    "TORCH_",
    "PYTORCH_",
    "CUDA",
    "NCCL_",
    "NUMBA_",
    "CUPY_",
    "COMMPRESS_",
    "LD_",
    "PYTHON",
)
_server_env: dict[str, str] | None = None  # the fork server's environment, once it is started


def _loaded_with(env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name.startswith(IMPORT_TIME_VARIABLES)}


def _start_method(env: Mapping[str, str]) -> str:
    """``forkserver`` where the platform has it and the server loaded its imports under
    ``env``'s import-time variables (the first launch starts it under them), else ``spawn``."""
    global _server_env
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    if _server_env is None:
        multiprocessing.set_forkserver_preload(list(PRELOAD))
        multiprocessing.forkserver.ensure_running()  # under ``env``, which the caller has set
        _server_env = dict(env)
    return "forkserver" if _loaded_with(env) == _loaded_with(_server_env) else "spawn"


@dataclass(frozen=True)
class _Launcher:
    """What a rank forked from the fork server takes back from the process that launched it:
    its environment and its standard output and error (the server keeps those it started
    with). Pickled as the rank starts, which hands the two streams over to it."""

    server_env: dict[str, str]
    env: dict[str, str]
    stdout: int
    stderr: int

    def __reduce__(self) -> tuple[Any, ...]:
        return _Launcher._in_rank, (self.server_env, self.env, reduction.DupFd(self.stdout), reduction.DupFd(self.stderr))

    @staticmethod
    def _in_rank(server_env: dict[str, str], env: dict[str, str], stdout: Any, stderr: Any) -> _Launcher:
        return _Launcher(server_env, env, stdout.detach(), stderr.detach())

    def restore(self) -> None:
        """In the rank: the launcher's environment with what the elastic launcher set for
        this rank (what differs from the server's), and the launcher's streams."""
        this_rank = {name: value for name, value in os.environ.items() if self.server_env.get(name) != value}
        os.environ.clear()
        os.environ.update({**self.env, **this_rank})
        for stream, fd in ((1, self.stdout), (2, self.stderr)):
            os.dup2(fd, stream)
            os.close(fd)


def _entry(
    fn: Callable[..., Any],
    backend: str,
    threads: int,
    timeout: float,
    args: tuple[Any, ...],
    launcher: _Launcher | None,
) -> bytes:
    """One rank: join the group the launcher's variables describe, run ``fn``, leave.

    ``launcher`` is what a rank forked from the server takes back (None for a spawned rank).
    A rank still running after ``timeout`` seconds prints every thread's stack and exits
    with status 1; the launcher then ends the other ranks and reports it."""
    import torch
    import torch.distributed as dist

    if launcher is not None:
        launcher.restore()
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
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes with an initialized
    default process group; return their results in rank order.

    ``fn`` must be importable (a module-level function). A failing rank, or one still
    running after ``timeout`` seconds, raises torch's ``ChildFailedError`` naming the rank,
    its exit code and its traceback. The ranks start with ``GOMP_SPINCOUNT=10000`` unless
    the environment chooses how OpenMP workers wait (:mod:`commpress.kernels.cpu.openmp`).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    threads = max(1, (os.cpu_count() or 1) // world_size)
    with _environment(rank_env()):
        start_method = _start_method(os.environ)
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world_size,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",  # as ``torchrun --standalone``: the store lives in this process
            rdzv_endpoint="127.0.0.1:0",
            local_addr="127.0.0.1",
            max_restarts=0,
            start_method=start_method,
        )
        forked = start_method == "forkserver"
        launcher = _Launcher(dict(_server_env or {}), dict(os.environ), 1, 2) if forked else None
        out = elastic_launch(config, _entry)(fn, backend, threads, timeout, args, launcher)
    return [pickle.loads(out[r]) for r in range(world_size)]


@contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` added to the environment the ranks inherit (a spawned rank copies it at
    start, a forked one takes it back from :class:`_Launcher`); ours is restored afterwards."""
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
