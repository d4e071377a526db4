"""Backends that run generator compressors as futures, plus the in-process simulated world."""

from __future__ import annotations

from typing import Any

from commpress.comm.backend import Backend
from commpress.comm.counters import Traffic
from commpress.comm.simulated import SimulatedWorld
from commpress.errors import ConfigError

__all__ = ["Backend", "SimulatedWorld", "Traffic", "make_backend"]


def make_backend(name: str, process_group: Any = None, rounds: int = 1) -> Backend:
    """The ``"torch"`` or ``"mpi"`` backend over ``process_group`` (None: the world)."""
    if name == "torch":
        from commpress.comm.torch_backend import TorchBackend

        return TorchBackend(process_group, rounds=rounds)
    if name == "mpi":
        from commpress.comm.mpi_backend import MPIBackend

        return MPIBackend(process_group, rounds=rounds)
    raise ConfigError(f"backend = {name!r} is not accepted; accepted: torch, mpi")
