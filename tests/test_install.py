"""The README's install story: build a wheel, install it into a fresh virtual environment,
and run the installed ``commpress`` command from outside the checkout.

The wheel is built from a copy of the checkout (``pip wheel . --no-deps
--no-build-isolation``, offline, leaving the checkout's build/ alone). The fresh venv has
no pip of its own and no packages: torch and numpy come from the test environment through
a ``.pth`` file naming its site-packages, since installing torch again takes longer than
the rest of the test and would test pip's dependency resolution, not this package. That
``.pth`` line only adds the directory to ``sys.path``; the ``.pth`` files inside it (the
checkout's editable install among them) are not run, and the venv's own site-packages,
holding the wheel, comes first. The test checks that ``commpress`` is imported from the
venv, that the wheel carries the package data, and that a 2-rank demo runs through the
installed console script.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".venv", ".git", "build", "dist", ".asv", "*.egg-info", "__pycache__", "bench-results")


def _run(argv: list[str], cwd: Path, timeout: float = 180, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{output[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; returns the venv's directory."""
    tmp = tmp_path_factory.mktemp("install")
    src, dist, env_dir = tmp / "src", tmp / "dist", tmp / "venv"
    shutil.copytree(ROOT, src, ignore=SKIP)
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)], src)
    (wheel,) = dist.glob("commpress-*.whl")
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).strip()
    (Path(purelib) / "test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)], tmp)
    return env_dir


def test_wheel_carries_the_package_data(installed):
    (wheel,) = installed.parent.joinpath("dist").glob("commpress-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = [*(ROOT / "commpress/kernels/cuda").glob("*.cu*"), *(ROOT / "commpress/workloads/shapes").glob("*.json")]
    assert wanted
    missing = [str(p.relative_to(ROOT)) for p in wanted if str(p.relative_to(ROOT)) not in names]
    assert not missing, f"not in the wheel: {missing}"


def test_commpress_is_imported_from_the_venv(installed, tmp_path):
    where = _run([str(installed / "bin" / "python"), "-c", "import commpress; print(commpress.__file__)"], tmp_path)
    assert Path(where.strip()).is_relative_to(installed), where


def test_installed_console_script_runs_the_demo(installed, tmp_path):
    env = dict(os.environ, PATH=f"{installed / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    argv = [str(installed / "bin" / "commpress"), "demo", "--ranks", "2", "--steps", "5", "--methods", "none;fp16"]
    table = _run(argv, tmp_path, env=env)
    assert re.search(r"method\s+bytes/step/rank\s+compression", table), table
    rows = {m.group(1): int(m.group(2).replace(",", "")) for m in re.finditer(r"^(none|fp16)\s+([\d,]+)\s", table, re.M)}
    assert set(rows) == {"none", "fp16"}, table
    assert rows["none"] == 2 * rows["fp16"] > 0, table
