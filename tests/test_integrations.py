"""Every example of docs/integrations.md, run as the doc says on 2 CPU processes.

The scripts are read from the doc's ``python`` blocks (so the doc cannot go stale): each
block's first line is ``# <file>.py: <command>``. Complete scripts print, on every rank,
``rank R: loss L, sent B bytes``; the test checks that both ranks trained with commpress
(bytes sent through commpress > 0, the same on both ranks, finite loss). Launchers are
taken from this interpreter's environment (torchrun, accelerate); the Accelerate script
also runs without its launcher, in one process, as the doc says it does; accelerate gets
``--main_process_port 0`` so that runs on a shared machine do not collide on port 29500.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
BIN = Path(sys.executable).parent
REPORT = re.compile(r"rank (\d+): loss (\S+), sent (\d+) bytes")


def _blocks() -> dict[str, tuple[str, str]]:
    """file name -> (command, source) of every python block in the doc."""
    out = {}
    for source in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        head = re.match(r"# (\w+\.py): (.*)", source.splitlines()[0])
        assert head, f"docs/integrations.md: a python block does not start with '# <file>.py: <command>': {source[:80]!r}"
        out[head.group(1)] = (head.group(2), source)
    return out


BLOCKS = _blocks()


def _argv(command: str) -> list[str]:
    """The doc's command with its program taken from this environment."""
    argv = shlex.split(command.split(" (")[0])
    argv[0] = sys.executable if argv[0] == "python" else str(BIN / argv[0])
    if argv[1:2] == ["launch"]:
        argv[2:2] = ["--main_process_port", "0"]
    return argv


def _run(tmp_path: Path, name: str, extra: str = "", command: str | None = None) -> str:
    """Run the doc's block ``name`` with its own command (or ``command``); its output."""
    command = command or BLOCKS[name][0]
    (tmp_path / name).write_text(BLOCKS[name][1] + extra)
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", HF_HOME=str(tmp_path / "hf"))
    if os.geteuid() == 0:  # Open MPI refuses root unless told (the doc says so)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(_argv(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{output[-4000:]}"
    return output


def test_doc_has_the_three_launchers():
    assert {"train_torchrun.py", "train_mpirun.py", "train_lightning.py", "train_accelerate.py"} <= set(BLOCKS)
    assert "lightning_strategy.py" in BLOCKS


@pytest.mark.parametrize("name", ["train_torchrun.py", "train_mpirun.py", "train_lightning.py", "train_accelerate.py"])
def test_script_trains_with_commpress_on_two_ranks(tmp_path, name):
    output = _run(tmp_path, name)
    reports = {int(rank): (float(loss), int(sent)) for rank, loss, sent in REPORT.findall(output)}
    assert sorted(reports) == [0, 1], f"expected a report from ranks 0 and 1:\n{output[-4000:]}"
    (loss0, sent0), (loss1, sent1) = reports[0], reports[1]
    assert math.isfinite(loss0) and math.isfinite(loss1)
    assert sent0 > 0, f"{name}: commpress sent nothing (the hook never ran):\n{output[-2000:]}"
    assert sent0 == sent1


def test_accelerate_script_runs_without_its_launcher_too(tmp_path):
    """``python train_accelerate.py``: Accelerate trains in one process, register applies
    nothing, the script runs as written."""
    output = _run(tmp_path, "train_accelerate.py", command="python train_accelerate.py")
    reports = REPORT.findall(output)
    assert [(rank, sent) for rank, _, sent in reports] == [("0", "0")], output[-2000:]
    assert math.isfinite(float(reports[0][1]))


def test_lightning_strategy_snippet_builds_before_the_process_group(tmp_path):
    check = (
        "\nimport torch.distributed as dist\n"
        "assert not dist.is_initialized()\n"
        "print('built', type(strategy).__name__, state.config.method)\n"
    )
    assert "built DDPStrategy topk" in _run(tmp_path, "lightning_strategy.py", check)
