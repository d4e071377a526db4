"""The README's demo table is current: re-run the demo as ``scripts/demo`` does
(``python -m commpress demo``: every demo row, 2 ranks, 200 steps, about 100 s) and compare
each row's bytes per step (exactly) and final loss (to the printed precision, 4 decimals)
with the table in README.md. Step times are not compared: they depend on the machine.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.demo, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[1]
HEADER = re.compile(r"^method\s+bytes/step/rank\s+compression\s+step ms\s+final loss\s+gap vs \S+$", re.M)
LOSS_ULP = 1e-4  # the table prints losses with 4 decimals


def parse_table(text: str) -> dict[str, tuple[int, float]]:
    """method -> (bytes/step/rank, final loss) of the first demo table in ``text``."""
    match = HEADER.search(text)
    assert match, "no demo table (header 'method  bytes/step/rank  compression ...') found"
    rows = {}
    for line in text[match.end() :].splitlines()[2:]:
        cells = line.split()
        if len(cells) != 6:
            break
        rows[cells[0]] = (int(cells[1].replace(",", "")), float(cells[4]))
    assert rows, "the demo table has no rows"
    return rows


def test_parse_table_reads_bytes_and_losses():
    text = (
        "method  bytes/step/rank  compression  step ms  final loss  gap vs none\n"
        "------  ---------------  -----------  -------  ----------  -----------\n"
        "none          2,900,480         1.0x     21.4      2.3003       +0.00%\n"
        "fp16          1,450,240         2.0x     23.3      2.3002       -0.00%\n"
        "```\n"
    )
    assert parse_table(text) == {"none": (2900480, 2.3003), "fp16": (1450240, 2.3002)}


def test_readme_demo_table_matches_a_fresh_run(tmp_path):
    readme = parse_table((ROOT / "README.md").read_text())
    proc = subprocess.run([sys.executable, "-m", "commpress", "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    fresh = parse_table(proc.stdout)
    assert list(fresh) == list(readme), f"README rows {list(readme)}, demo rows {list(fresh)}:\n{proc.stdout}"
    diffs = [
        f"{method}: README {readme[method][0]:,} bytes, loss {readme[method][1]:.4f}; "
        f"demo {fresh[method][0]:,} bytes, loss {fresh[method][1]:.4f}"
        for method in readme
        if readme[method][0] != fresh[method][0] or abs(readme[method][1] - fresh[method][1]) > LOSS_ULP + 1e-9
    ]
    assert not diffs, "README demo table is out of date (re-run scripts/demo and paste its table):\n" + "\n".join(
        [*diffs, "", proc.stdout]
    )
