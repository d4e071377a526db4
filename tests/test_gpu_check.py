"""scripts/gpu-check works before a GPU is there: its dry run on the CPU writes a report with
every part, runs the CPU sides and skips the CUDA sides with their reason; a part past its
cap is killed and recorded as a timeout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commpress.bench.gpucheck.__main__ import PARTS, main, run_part
from commpress.bench.gpucheck.ddp import WireDigest
from commpress.bench.gpucheck.env import tree

ROOT = Path(__file__).resolve().parents[1]
#: part -> what its dry run must have run on the CPU
CPU_SIDES = {
    "env": ["versions"],
    "tests": ["pytest"],
    "kernels": ["cpu table"],
    "ddp": ["cpu-gloo-2", "cpu-gloo-1"],
    "configs": ["cpu-gloo-2", "cpu-gloo-1"],
    "lowrank": ["cpu rows"],
    "fsdp": ["cpu-gloo-1"],
    "sharded": ["streaming-diloco cpu-gloo-1", "cross-group-hook cpu-gloo-1"],
}


@pytest.mark.multiproc
def test_the_dry_run_reports_every_part(tmp_path):
    env = {**os.environ, "PY": sys.executable, "CUDA_VISIBLE_DEVICES": ""}  # the chosen tests skip, GPU or not
    # --slack: the caps are sized for the lent GPU machine, not a busy CPU one
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check"), str(tmp_path), "--dry", "--slack", "6", "--budget", "3000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert done.returncode == 0 and report["status"] == "ok", done.stdout + done.stderr
    assert report["dry"] is True and set(report["parts"]) == set(PARTS) == set(CPU_SIDES)
    for name, part in report["parts"].items():
        assert part["status"] == "ok", (name, part)
        assert set(CPU_SIDES[name]) <= set(part["ran"]), (name, part["ran"])
        assert all(c["ok"] for c in part["checks"]), (name, part["checks"])
        assert json.loads((tmp_path / f"{name}.json").read_text())["status"] == "ok"
    for name in ("kernels", "ddp", "configs", "lowrank", "fsdp", "sharded"):
        reasons = report["parts"][name]["skipped"].values()
        assert reasons and all("--dry" in r for r in reasons), (name, reasons)
    assert not any("cuda" in side for p in report["parts"].values() for side in p["ran"])
    ddp = report["parts"]["ddp"]["figures"]
    assert set(ddp["losses"]["cpu-gloo-2"]) == set(ddp["methods"]) and len(ddp["losses"]["cpu-gloo-2"]["topk"]) == 2
    outcome = report["parts"]["configs"]["figures"]["outcome"]["cpu-gloo-2"]
    assert outcome["slow-link.toml"] == outcome["dion.toml"] == "trained", outcome  # AdamW's; Muon + AdamW's
    assert outcome["fsdp_qsdp.toml"].startswith("refused: ") and "[fsdp]" in outcome["fsdp_qsdp.toml"], outcome
    tests = report["parts"]["tests"]["figures"]
    assert tests["counts"] == {"skipped": len(tests["chosen"])} and "tests/test_cuda_kernels.py" in tests["files"]
    log = (tmp_path / "gpu-check.log").read_text()
    assert all(f"===== {name} " in log for name in PARTS)


def test_a_part_past_its_cap_is_killed(tmp_path):
    with open(tmp_path / "log", "w") as log:
        report = run_part("env", tmp_path, dry=True, cap=0.05, log=log)
    assert report["status"] == "timeout" and "cap of 0 s" in report["error"]
    assert not (tmp_path / "env.json").exists()


def test_a_check_inside_a_check_refuses(monkeypatch, capsys):
    monkeypatch.setenv("COMMPRESS_GPU_CHECK", "1")
    with pytest.raises(SystemExit):
        main(["x", "--dry"])
    assert "a GPU check is running above this process" in capsys.readouterr().err


def test_bad_arguments_name_the_option(capsys):
    for argv, message in ((["x", "--parts", "env,gpu"], "unknown part(s) ['gpu']"), (["x", "--budget", "5"], "--budget = '5'")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err


def test_the_wire_digest_sees_every_byte_in_channel_order():
    a, b, c = WireDigest(), WireDigest(), WireDigest()
    x, y = torch.tensor([1.0, -0.0]), torch.tensor([1.0, 0.0])  # equal as numbers, not as bytes
    a.record(("world", 0), x)
    b.record(("world", 0), y)
    c.record(("world", 0), x)
    c.record(("world", 1), torch.tensor([True]))
    assert a.digests() != b.digests() and a.nbytes == b.nbytes == 8
    assert c.digests()["world/0"] == a.digests()["world/0"] and set(c.digests()) == {"world/0", "world/1"}


def test_env_names_the_files_that_differ_from_the_commit(tmp_path):
    """A tree copied with an older git directory is recorded as that commit plus its changes."""
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("x = 1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert tree(tmp_path) == {"commit": head, "changed": []}
    (tmp_path / "b.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("")  # untracked: not a change to what the commit holds
    assert tree(tmp_path) == {"commit": head, "changed": ["b.py"]}
    assert tree(tmp_path / "missing") == {"commit": None, "changed": None}
