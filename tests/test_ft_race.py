"""`python -m commpress.bench.ft_race`: three replica groups on this machine (loopback, no
linkemu), replica 2 killed every few steps and started again, Streaming DiLoCo through the
manager. The run reaches its target, the kills happened, and every process ends cleanly
(the restarted replica heals, the final syncs line up)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

pytestmark = pytest.mark.multiproc
ROOT = Path(__file__).resolve().parents[1]


def _free_port_pair() -> int:
    """A port whose successor is free too (the lighthouse and the meeting store)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free pair of ports")


def test_a_killed_replica_rejoins_and_the_run_reaches_its_target(tmp_path):
    port, out = _free_port_pair(), tmp_path / "result.json"
    args = ["--mode", "commpress", "--config", str(ROOT / "docs/configs/streaming-diloco.toml")]
    args += ["--target", "2.75", "--kill-every", "6", "--eval-every", "5", "--max-steps", "200", "--json", str(out)]
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env["PYTHONPATH"] = str(ROOT)
        log = (tmp_path / f"rank{rank}.log").open("w")
        cmd = [sys.executable, "-m", "commpress.bench.ft_race", *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    for rank, p in enumerate(procs):
        p.wait(timeout=300)
        assert p.returncode == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    result = json.loads(out.read_text())
    assert result["reached"] and result["kills"] >= 1, result
    assert result["steps_to_target"] <= 200 and result["seconds_to_target"] > 0


def test_kills_come_at_any_point_of_a_round_the_same_for_every_run():
    from commpress.bench.ft_race import KillSchedule

    a, b = KillSchedule(100, 0), KillSchedule(100, 0)
    assert [a.next() for _ in range(5)] == [b.next() for _ in range(5)]  # one seed: every row, the same kills
    schedule = KillSchedule(100, 3)
    kills = [schedule.next() for _ in range(400)]
    assert {due for due, _ in kills} == set(range(96, 104))  # every position in a round of up to 8 steps
    assert all(0 <= fraction < 1 for _, fraction in kills) and len({round(f, 1) for _, f in kills}) >= 10
    assert KillSchedule(2, 0).next()[0] >= 1
