"""Join torch.distributed from whatever launched this process: torchrun or mpirun.

DDP needs a torch group even when collectives go through MPI, so under ``mpirun`` this starts
gloo at ``MASTER_ADDR``/``MASTER_PORT``, or else at a free port rank 0 shares through mpi4py.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Launch", "detect_launcher", "init_from_env"]

# (rank, size, local size) variables of known MPI launchers, first match wins.
_MPI_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_SIZE"),
)


@dataclass(frozen=True)
class Launch:
    """How this process was started: ``kind`` is "torchrun", "mpirun" or "none"."""

    kind: str
    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1


def detect_launcher(environ: Mapping[str, str] | None = None) -> Launch:
    """Read the launcher's variables from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ

    def number(var: str, default: int | None = None) -> int:
        raw = env.get(var)
        if raw is None and default is not None:
            return default
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise RuntimeError(f"environment variable {var}={raw!r} is not an integer (set by the launcher?)") from None

    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        world = number("WORLD_SIZE")
        return Launch("torchrun", number("RANK"), world, number("LOCAL_WORLD_SIZE", world))
    for rank_var, size_var, local_var in _MPI_VARS:
        if rank_var in env and size_var in env:
            world = number(size_var)
            return Launch("mpirun", number(rank_var), world, number(local_var, world))
    return Launch("none")


def init_from_env(backend: str = "gloo", timeout: float = 300.0) -> Launch:
    """Initialize the default torch process group from the torchrun or mpirun environment."""
    launch = detect_launcher()
    if launch.kind == "none":
        raise RuntimeError(
            "not started by torchrun or mpirun (no RANK/WORLD_SIZE/MASTER_ADDR nor OMPI_COMM_WORLD_RANK/PMI_RANK "
            "in the environment): launch with `torchrun --nproc_per_node N ...` or `mpirun -n N ...`"
        )
    if launch.kind == "mpirun" and "MASTER_ADDR" not in os.environ:
        addr, port = _agree_on_address(launch)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    return launch


def _agree_on_address(launch: Launch) -> tuple[str, int]:
    """Rank 0's address and a free port, broadcast over MPI (loopback if all ranks share a host)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            "under mpirun without MASTER_ADDR/MASTER_PORT, commpress needs mpi4py to agree on a rendezvous "
            "address: pip install mpi4py (commpress's mpi extra), or export MASTER_ADDR and MASTER_PORT"
        ) from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != launch.world_size:
        raise RuntimeError(f"MPI reports {comm.Get_size()} ranks but the environment says {launch.world_size}")
    hosts = comm.allgather(socket.gethostname())
    choice = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        addr = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(hosts[0])
        choice = (addr, port)
    return comm.bcast(choice, root=0)
