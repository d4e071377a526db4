"""The CUDA side without a GPU: every kernel source compiles for sm_80 and sm_90, kernel names
used by the launchers exist, the sources ship as package data, and CuPy problems give clear errors."""

import re
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

from commpress.kernels.cuda import _cupy

KERNELS = Path(_cupy.__file__).parent
SOURCES = sorted(p.stem for p in KERNELS.glob("*.cu"))
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_kernel_sources_compile_for_sm80_and_sm90(tmp_path):
    """Compile exactly the text CuPy receives (headers inlined) with the options it gets, all sources at once."""
    arches = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in (80, 90)]
    jobs = {}
    for name in SOURCES:
        src = tmp_path / f"{name}.cu"
        src.write_text(_cupy.source(name))
        cmd = [NVCC, *_cupy.OPTIONS, "-Werror=all-warnings", "-fatbin", *arches, "-o", str(tmp_path / f"{name}.fatbin"), str(src)]
        jobs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failures = {name: job.communicate()[0] for name, job in jobs.items() if job.wait() != 0}
    assert not failures, failures
    assert len(SOURCES) == 7 and all((tmp_path / f"{name}.fatbin").stat().st_size > 0 for name in SOURCES)


def test_launchers_name_existing_kernels():
    launcher = (KERNELS / "_launch.py").read_text()
    calls = re.findall(r'launch\(\s*"(\w+)",\s*"(\w+)"', launcher)
    assert len(calls) >= 12
    for module, function in calls:
        assert re.search(rf'extern "C" __global__ void {function}\(', _cupy.source(module)), (module, function)


def test_kernel_sources_are_package_data():
    pyproject = tomllib.loads((KERNELS.parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["commpress"]
    for path in [*KERNELS.glob("*.cu"), *KERNELS.glob("*.cuh")]:
        rel = f"kernels/cuda/{path.name}"
        assert any(fnmatch(rel, pattern) for pattern in patterns), rel


def test_missing_cupy_names_the_extra(monkeypatch):
    _cupy.require_cupy.cache_clear()
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(RuntimeError, match=r"pip install cupy-cuda13x \(commpress's cuda12/cuda13 extra"):
        _cupy.require_cupy()
    _cupy.require_cupy.cache_clear()


def test_cupy_for_another_cuda_major_names_the_right_extra(monkeypatch):
    class Runtime:
        @staticmethod
        def runtimeGetVersion():
            return 12080

    class FakeCupy:  # only the attribute require_cupy reads
        cuda = type("cuda", (), {"runtime": Runtime})

    _cupy.require_cupy.cache_clear()
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(
        RuntimeError, match=r"CUDA 12 but torch uses CUDA 13.0: uninstall cupy-cuda12x and pip install cupy-cuda13x"
    ):
        _cupy.require_cupy()
    _cupy.require_cupy.cache_clear()
