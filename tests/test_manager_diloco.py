"""Streaming DiLoCo under a torchft Manager (CPU, gloo, the lighthouse in this process,
replica groups as processes: tests/manager_diloco_workers.py).

Without failures the syncs through the manager are the plain gloo run's, bit for bit, with
either merge of a delayed average (both sum two replicas' contributions once and divide by
two; the fragment and the compressors' step come from the manager's committed syncs, the
plain run's rounds). A replica killed
inside a sync's average leaves the survivor's anchor, outer state and compressor state as
they were and that fragment with its steps, as if the sync had not run (an eager move taken
back); the restarted replica heals at its first
sync and ends with the survivor's model, anchor and shared state, bit for bit.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

from test_manager import _both, _finish, _same, _start, _when_alone
from torch.distributed import TCPStore
from torchft.coordination import LighthouseServer

from commpress.comm import SimulatedWorld
from commpress.comm.averager import ParameterAverager
from commpress.config import Config
from commpress.errors import ConfigError
from commpress.hooks import CommState
from commpress.local_sgd import DiLoCo, from_config

pytestmark = pytest.mark.multiproc
WORKERS = "manager_diloco_workers.py"
METHOD_NAMES = ("none", "terngrad", "topk")


def test_diloco_and_local_sgd_through_the_manager_are_the_plain_runs_bit_for_bit(tmp_path):
    _both("same", tmp_path, WORKERS)
    for replica in (0, 1):
        seen = json.loads((tmp_path / f"same{replica}.json").read_text())
        assert sorted(seen) == ["local_sgd", "none", "slow-link-h1", "terngrad", "topk"]
        for method, s in seen.items():
            assert s["commits"] and all(s["commits"]), (method, s)
            assert (s["model"], s["anchor"], s["changed"]) == (True, True, True), (method, s)
        for method in [*METHOD_NAMES, "slow-link-h1"]:  # the sync in flight at the save, asked then and saved as it lands
            assert seen[method]["outcomes"] == ["apply"], seen
        assert seen["local_sgd"]["outcomes"] == [], seen  # no delay: nothing in flight between steps
        assert seen["local_sgd"]["periods"] == [2, 2, 4, 4], seen  # QSR's rounds (finish() syncs the last, at step 9)


@pytest.mark.parametrize("method", ["topk", "terngrad", "powersgd"])
def test_a_replica_killed_in_a_sync_is_survived_and_its_restart_heals_bit_for_bit(tmp_path, method):
    """Top-k; TernGrad entropy-coded (the slow-link config's method), whose healing
    replica codes longer than the survivor (made so: ``_spied`` in the workers): its frame
    is sent and dropped, no peer waits; PowerSGD, whose warm starts (shared state) the
    healed replica stages by replaying the sync it healed in."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=30000, heartbeat_timeout_ms=2000)
    meet = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    survivor, killed, joiner = (f"{role}-{method}" for role in ("survivor", "killed", "joiner"))
    try:
        addr = lighthouse.address()
        procs = [_start(survivor, tmp_path, addr, meet.port, 0, WORKERS)]
        _finish([_start(killed, tmp_path, addr, meet.port, 1, WORKERS)])
        assert not (tmp_path / f"{killed}.json").exists()
        _when_alone(meet, procs)
        _finish([*procs, _start(joiner, tmp_path, addr, meet.port, 1, WORKERS)])
    finally:
        lighthouse.shutdown()
    s, j = (json.loads((tmp_path / f"{n}.json").read_text()) for n in (survivor, joiner))
    if method == "terngrad":
        assert any(j["outside"]) and not any(s["outside"]), (s["outside"], j["outside"])
    # anchor, outer state, compressor state as they were; the fragment with the step's values, not the anchor's
    assert s["kept"] == [True, True, True, True, True], s
    assert s["alone"] >= 1 and not s["healed"], s
    assert j["healed"] and j["step"] == s["step"], (s, j)
    assert j["clock"] == s["clock"], (s, j)  # the restarted replica took its peer's step count when it healed
    for seen in (s, j):  # outer_lr = "sqrt_twice_replicas": sqrt(2M) of each sync's M participants, 1.0 alone
        assert seen["lrs"] == [math.sqrt(2 * m) if m > 1 else 1.0 for m in seen["participants"]], seen
    assert {1, 2} <= set(s["participants"]), s
    if method != "powersgd":  # (PowerSGD runs torch's ops, no numba kernels)
        assert j["kernels"] == [False, True], j  # the restarted process loads its kernels before its first sync
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in (survivor, joiner))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert _same(a["shared"], b["shared"])


def test_what_does_not_run_under_a_manager_is_refused():
    cfg = Config.load({"local_sgd": {"algorithm": "co2", "staleness_penalty": "adaptive"}})
    with pytest.raises(ConfigError, match=r"CO2: staleness_penalty = 'adaptive' is not accepted under a torchft Manager"):
        from_config(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters()), cfg, manager=object())
    with pytest.raises(ConfigError, match=r"\[local_sgd\].*register"):
        CommState({"local_sgd": {"algorithm": "diloco"}}, None, manager=object())


def test_a_skipped_sync_takes_its_eager_move_back():
    """The sync that does not count under a manager (:meth:`DiLoCo._skip_sync`) leaves the
    local values where the steps alone took them: on a linear loss (the same gradient
    wherever the values are) that is the plain run without the sync, to float tolerance."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    twin = copy.deepcopy(net)
    slopes = [torch.randn_like(p) for p in net.parameters()]
    backend = SimulatedWorld(1).backends[0]
    opt, twin_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    averager = ParameterAverager("none", backend=backend)
    trainer = DiLoCo(net, opt, 2, outer_lr=1.5, outer_momentum=0.0, nesterov=False, sync_delay=1, averager=averager)
    for step in (1, 2, 3):  # the sync starts at the end of step 2 with its eager move, then step 3
        for model, optimizer in ((net, opt), (twin, twin_opt)):
            sum((p * k).sum() for p, k in zip(model.parameters(), slopes)).backward()
            trainer.local_step() if model is net else optimizer.step()
            optimizer.zero_grad()
        if step < 3:  # the average due after step 3 is left in flight
            trainer.apply_due()
    (flight,) = trainer._in_flight
    assert flight.start is not None and not torch.equal(flight.start, trainer.flat.read())
    trainer._skip_sync(flight)
    for a, b in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)
