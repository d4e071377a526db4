"""Streaming DiLoCo between replica groups of an FSDP2-sharded model under torchft (CPU,
gloo, 2 groups x 2 shards, the lighthouse in this process: tests/manager_sharded_workers.py).

Every rank syncs its shard through a manager of its own (group rank = shard): without
failures that is the plain sharded run (``register(..., mesh=)``) bit for bit, for
Streaming DiLoCo and for CO2; an inf in one shard skips the sync on every rank and puts
every shard back at its anchor; a replica
group killed inside a sync's average leaves each survivor rank's anchor, outer state and
compressor state as they were (the group's ranks vote, so none waits for a shard whose
average failed), and the restarted group heals shard by shard from its peer's ranks and
ends with their shards and shared state, bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

from test_manager import _finish, _same, _start, _when_alone
from torch.distributed import TCPStore
from torchft.coordination import LighthouseServer

from commpress.bench.launch import run_local

sys.path.insert(0, str(Path(__file__).parent))
import manager_sharded_workers

pytestmark = pytest.mark.multiproc
WORKERS = "manager_sharded_workers.py"


def test_sharded_diloco_through_the_managers_is_the_plain_sharded_run_bit_for_bit_and_the_rest_is_refused():
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=2000)
    try:
        ranks = run_local(manager_sharded_workers.same_runs, 4, lighthouse.address())
    finally:
        lighthouse.shutdown()
    for rank in ranks:
        for name in ("streaming", "co2"):
            r = rank[name]
            assert r["sharded"] and r["commits"] and all(r["commits"]), (name, r)
            assert (r["model"], r["anchor"], r["changed"]) == (True, True, True), (name, r)
        assert rank["streaming"]["lr"] == 2**0.5  # sqrt of the replica groups that average, not of the ranks
        assert rank["non_finite"] == [True, True, True]  # not committed, anchor kept, local values at it
    without, with_mesh = ranks[0]["refused"]
    assert "under a torchft Manager on a model sharded with fully_shard (FSDP2)" in without
    assert "this model takes only [local_sgd]" in without
    assert "mesh=" in with_mesh and "sharded over its replica group's ranks and no mesh" in with_mesh


def test_a_replica_group_killed_in_a_sync_is_survived_and_its_restart_heals_every_shard(tmp_path):
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=30000, heartbeat_timeout_ms=2000)
    meet = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    try:
        addr = lighthouse.address()
        survivors = [_start("survivor", tmp_path, addr, meet.port, rank, WORKERS) for rank in (0, 1)]
        _finish([_start("killed", tmp_path, addr, meet.port, rank, WORKERS) for rank in (2, 3)])
        assert not list(tmp_path.glob("killed*.json"))
        _when_alone(meet, survivors)
        _finish([*survivors, *(_start("joiner", tmp_path, addr, meet.port, rank, WORKERS) for rank in (2, 3))])
    finally:
        lighthouse.shutdown()
    for shard in (0, 1):
        pair = (f"survivor{shard}", f"joiner{shard + 2}")
        s, j = (json.loads((tmp_path / f"{name}.json").read_text()) for name in pair)
        assert s["kept"] == [True, True, True], s  # anchor, outer state, compressor state
        if shard == 1:  # its own average succeeded; the vote stopped it with shard 0's failure
            assert "failed on a rank holding another shard" in s["error"], s
        assert s["commits"].count(False) == 1 and s["alone"] >= 1 and not s["healed"], s
        assert j["healed"] and all(j["commits"]) and j["step"] == s["step"], (s, j)
        assert {1, 2} <= set(s["participants"]), s
        a, b = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in pair)
        assert all(torch.equal(x, y) for x, y in zip(a["model"], b["model"]))
        assert _same(a["shared"], b["shared"])
    first, second = (torch.load(tmp_path / f"survivor{rank}.pt", weights_only=True)["model"] for rank in (0, 1))
    assert [t.shape for t in first] != [t.shape for t in second]  # the two ranks hold different shards
