"""asv_bench/ stays importable and well-formed: ``asv check`` (discovers the benchmarks in
this environment and checks their signatures; runs none of them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ASV_DIR = Path(__file__).resolve().parents[1] / "asv_bench"
ASV = Path(sys.executable).parent / "asv"  # from the test extra


def test_asv_check_finds_no_problems():
    assert ASV.exists(), f"{ASV} is missing: install the test extra (pip install -e '.[test]')"
    proc = subprocess.run([str(ASV), "check", "--python=same"], cwd=ASV_DIR, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "No problems found" in output, output[-4000:]
