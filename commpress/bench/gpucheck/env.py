"""Part ``env``: the machine the check ran on (GPU, CUDA, versions of what commpress uses)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

from commpress.bench.gpucheck.part import Report, main

#: Distributions whose versions are recorded (absent ones are recorded as None).
PACKAGES = ("torch", "numpy", "numba", "numba-cuda", "cupy-cuda13x", "cupy-cuda12x", "pytest", "lightning")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


ROOT = Path(__file__).resolve().parents[3]  # the working tree the check runs from


def _git(root: Path, *args: str) -> str | None:
    """The output of ``git args`` in ``root``, when it is a git checkout."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def tree(root: Path = ROOT) -> dict[str, object]:
    """The commit and the tracked files that differ from it: a working tree copied to another
    machine can carry a git directory older than its files, so the commit alone does not say
    what ran."""
    head = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    changed = sorted(line[3:] for line in status.splitlines()) if status is not None else None
    return {"commit": head.strip() if head else None, "changed": changed}


def run(report: Report, dry: bool) -> None:
    facts = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **tree(),
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "versions": {name: _version(name) for name in PACKAGES},
    }
    report.ran.append("versions")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = {
            "name": props.name,
            "count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
        }
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        facts["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
        report.ran.append("gpu")
    else:
        report.skip("gpu", "no CUDA device")
    try:
        import cupy

        facts["cupy"] = {"version": cupy.__version__, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion()}
    except Exception as exc:  # absent, or no driver: a fact, not a failure
        facts["cupy"] = f"{type(exc).__name__}: {exc}"
    report.figures.update(facts)


if __name__ == "__main__":
    main("env", run)
