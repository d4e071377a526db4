"""CO2 under a torchft Manager (CPU, gloo, the lighthouse in this process, replica groups
as processes: tests/manager_co2_workers.py).

Without failures the syncs through the manager are the plain gloo run's, bit for bit: the
one-round-stale average with momentum, clipping and a staleness penalty, and Top-k's error
feedback, and QSR's rounds; a ``state_dict()`` saved with a sync in flight lands it early
and changes no bit.
A replica killed as it starts a sync's average leaves the survivor's anchor, outer state
and compressor state as they were when that sync lands a round later; the restarted replica
heals at its first sync and ends with the survivor's model and shared state, bit for bit;
from torchft's first-step sync CO2 and the slow-link config's DiLoCo commit every sync.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

from test_manager import _both, _finish, _same, _start, _when_alone
from torch.distributed import TCPStore
from torchft.coordination import LighthouseServer

pytestmark = pytest.mark.multiproc
WORKERS = "manager_co2_workers.py"


def test_co2_through_the_manager_is_the_plain_run_bit_for_bit(tmp_path):
    _both("same", tmp_path, WORKERS)
    for replica in (0, 1):
        seen = json.loads((tmp_path / f"same{replica}.json").read_text())
        assert sorted(seen) == ["none", "qsr", "topk"]
        for name, s in seen.items():
            assert len(s["commits"]) == 4 and all(s["commits"]), (name, s)  # 3 rounds' ends and finish()
            started = 2 if name == "qsr" else 1  # syncs started by the save at step 4 (QSR: at 2 and 4; else at 3)
            assert s["saved"] == [True, [True] * started], (name, s)  # each landed: the one in flight by the save
            plain, managed = s["penalties"]
            assert plain == managed and len(plain) == 4, (name, s)
            assert (s["model"], s["anchor"], s["changed"]) == (True, True, True), (name, s)
        assert seen["qsr"]["periods"] == [2, 2, 4, 4], seen  # QSR's rounds (finish() syncs the last, at step 11)


def test_co2_and_diloco_commit_from_torchfts_first_step_sync(tmp_path):
    """With ``init_sync=True`` (torchft's default) replica 1 heals in the first sync: CO2
    lands it at once and restarts from the received anchor; the slow-link config's DiLoCo
    (delayed, TernGrad entropy-coded) takes the new anchor. Every sync commits, and the
    replicas, started from different models, end equal."""
    _both("first", tmp_path, WORKERS)
    seen = [json.loads((tmp_path / f"first{r}.json").read_text()) for r in (0, 1)]
    for name in ("co2", "diloco"):
        assert seen[0][name] and all(seen[0][name]) and seen[0][name] == seen[1][name], (name, seen)
        a, b = (torch.load(tmp_path / f"first-{name}{r}.pt", weights_only=True) for r in (0, 1))
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), name
        assert _same(a["shared"], b["shared"]), name


def test_a_replica_killed_in_a_sync_is_survived_and_its_restart_heals_bit_for_bit(tmp_path):
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=30000, heartbeat_timeout_ms=2000)
    meet = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    try:
        addr = lighthouse.address()
        procs = [_start("survivor", tmp_path, addr, meet.port, 0, WORKERS)]
        _finish([_start("killed", tmp_path, addr, meet.port, 1, WORKERS)])
        assert not (tmp_path / "killed.json").exists()
        _when_alone(meet, procs)
        _finish([*procs, _start("joiner", tmp_path, addr, meet.port, 1, WORKERS)])
    finally:
        lighthouse.shutdown()
    s, j = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("survivor", "joiner"))
    assert s["kept"] == [True, True, True], s  # anchor, outer state, compressor state as they were
    assert s["alone"] >= 1 and not s["healed"], s
    assert {1, 2} <= set(s["participants"]), s
    assert j["healed"] and j["restarted"] and j["step"] == s["step"], (s, j)
    assert j["clock"] == s["clock"], (s, j)  # the restarted replica took its peer's step count when it healed
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("survivor", "joiner"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert _same(a["shared"], b["shared"])
