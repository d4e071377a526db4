"""Run under ``mpirun -n N`` by tests/test_mpi.py: train the demo model with the MPI and
the torch (gloo) backends on the same seed; rank 0 writes what the test compares."""

from __future__ import annotations

import sys

import multiround  # noqa: F401  (registers test-multiround)
import torch

from commpress.comm.from_env import init_from_env
from commpress.workloads.train import train_ddp

CONFIGS = {
    "none": {"method": "none"},
    "fp16": {"method": "fp16"},
    "bf16": {"method": "bf16"},
    "multiround": {"method": "test-multiround"},  # 3 rounds, variable all-gathers, max all-reduce
}
STEPS = 4


def main(out_path: str) -> None:
    launch = init_from_env("gloo")
    torch.set_num_threads(1)
    results = {}
    for name, config in CONFIGS.items():
        for backend in ("torch", "mpi"):
            r = train_ddp({**config, "backend": backend}, steps=STEPS, bucket_cap_mb=0.25, return_params=True)
            results[f"{name}/{backend}"] = {"params": r.params, "bytes": r.bytes_per_step, "losses": r.losses}
    results["errors"] = _errors()
    if launch.rank == 0:
        torch.save(results, out_path)


def _errors() -> dict[str, str]:
    """Messages of the misuse checks that need a live MPI world."""
    from mpi4py import MPI

    from commpress.comm.mpi_backend import MPIBackend

    out = {}
    alone = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank(), 0)  # a communicator of one rank
    try:
        MPIBackend(alone)
    except RuntimeError as exc:
        out["world_sizes"] = str(exc)
    return out


if __name__ == "__main__":
    main(sys.argv[1])
