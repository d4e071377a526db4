"""commpress under a torchft Manager (CPU, gloo, the lighthouse in this process, replica
groups as processes: tests/manager_workers.py).

Without failures every method's run through the manager is the plain gloo run, bit for
bit: both sum two ranks' contributions exactly once (a + b) and divide by the same two
participants; the step counter is the manager's committed steps, the plain run's steps.
A replica killed in its backward pass leaves the survivor's model and commpress state as
they were before that step; the restarted replica heals and ends with the survivor's
model and shared commpress state, bit for bit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

torchft = pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

from torch.distributed import TCPStore  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

import commpress  # noqa: E402
from commpress.compressors import available  # noqa: E402
from commpress.config import Config, matrix  # noqa: E402
from commpress.errors import ConfigError  # noqa: E402
from commpress.hooks import CommState  # noqa: E402

pytestmark = pytest.mark.multiproc
WORKER = Path(__file__).with_name("manager_workers.py")
ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(
    scenario: str, out: Path, lighthouse: str, port: int, replica: int, worker: str = WORKER.name
) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(WORKER.parent)]), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(WORKER.with_name(worker)), scenario, str(out), lighthouse, str(port), str(replica)]
    log = (out / f"{scenario}{replica}.log").open("w")
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _log(p: subprocess.Popen) -> str:
    return Path(p.args[3], f"{p.args[2]}{p.args[6]}.log").read_text()[-3000:]


def _finish(procs: list[subprocess.Popen], timeout: float = 600) -> None:
    for p in procs:
        p.wait(timeout=timeout)
        assert p.returncode == 0, _log(p)


def _when_alone(meet: TCPStore, survivors: list[subprocess.Popen], timeout: float = 600) -> None:
    """Wait until the survivors have committed a step alone (they set ``alone`` in ``meet``).

    The restarted replica starts only then and joins at once, as an operator's restart does:
    a replica whose Manager heartbeats but has not joined holds up its peers' quorum (the
    lighthouse forms none from half or less of the heartbeating replicas), so a restart that
    waited for its peers after building its Manager would deadlock them.
    """
    deadline = time.monotonic() + timeout
    while not meet.check(["alone"]):
        for p in survivors:
            assert p.poll() is None, _log(p)
        assert time.monotonic() < deadline, "the survivors never committed a step alone"
        time.sleep(0.05)


def _both(scenario: str, out: Path, worker: str = WORKER.name) -> None:
    """Replicas 0 and 1 run ``scenario`` to its end, with a lighthouse that waits for both."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        port = _port()
        _finish([_start(scenario, out, lighthouse.address(), port, r, worker) for r in (0, 1)])
    finally:
        lighthouse.shutdown()


def test_every_method_through_the_manager_is_the_plain_run_bit_for_bit(tmp_path):
    _both("same", tmp_path)
    for replica in (0, 1):
        seen = json.loads((tmp_path / f"same{replica}.json").read_text())
        assert sorted(seen) == [m for m in available() if not m.startswith("test-")]  # the tests' own methods aside
        for method, s in seen.items():
            assert s == {"committed": True, "participants": 2, "model": True, "state": True, "changed": True}, (method, s)


def test_layerwise_plans_through_the_manager_are_the_plain_run_bit_for_bit(tmp_path):
    """Plans at steps 1, 3 and 5 (one of them moving tensors between settings) through the
    manager: the plain gloo run's plans, models and states, bit for bit."""
    _both("layerwise", tmp_path)
    seen = [json.loads((tmp_path / f"layerwise{r}.json").read_text()) for r in (0, 1)]
    for method in ("topk", "powersgd"):
        plans = [plan for s in seen for plan in s[method].pop("plans")]
        assert all(plan == plans[0] for plan in plans) and plans[0]["step"] == 5, (method, plans)
        assert len(set(plans[0]["labels"].values())) > 1, plans[0]  # tensors in several groups
        for s in seen:
            assert s[method] == {"committed": True, "participants": 2, "model": True, "state": True, "changed": True}


def test_every_method_commits_from_torchfts_first_step_sync(tmp_path):
    """With ``init_sync=True`` (torchft's default) replica 1 heals in step 0 while counted
    among the participants: every method (and Top-k with a layer-wise plan every step)
    commits every step and both replicas, started from different models, end equal bit for bit."""
    _both("first", tmp_path)
    seen = [json.loads((tmp_path / f"first{r}.json").read_text()) for r in (0, 1)]
    methods = sorted([m for m in available() if not m.startswith("test-")] + ["layerwise"])
    assert sorted(seen[0]) == sorted(seen[1]) == methods
    for method in seen[0]:
        assert seen[0][method] == seen[1][method] == [True] * len(seen[0][method]), method
        a, b = (torch.load(tmp_path / f"first-{method}{r}.pt", weights_only=True) for r in (0, 1))
        assert all(torch.equal(a[k], b[k]) for k in a), method


def test_one_bit_adam_through_the_manager_is_the_plain_run_and_heals(tmp_path):
    """1-bit Adam's warm-up step and compressed momenta through the manager give the plain
    gloo run bit for bit; from torchft's first-step sync (replica 1 heals in the warm-up,
    from another model init) both replicas end equal."""
    _both("adam", tmp_path)
    seen = [json.loads((tmp_path / f"adam{r}.json").read_text()) for r in (0, 1)]
    for s in seen:
        assert s["same"]["committed"] == s["first"]["committed"] == [True] * len(s["same"]["committed"]), s
        assert s["same"]["plain"] and s["same"]["sent"] > 0, s
    a, b = (torch.load(tmp_path / f"adam-first{r}.pt", weights_only=True)["model"] for r in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dion_through_the_manager_is_the_plain_run_and_heals(tmp_path):
    """Dion's iteration in the backward through the manager gives the plain gloo run's
    (at Muon's step) bit for bit; from torchft's first-step sync (replica 1 heals in step 0,
    from another model init) both replicas end with one model and one shared Q."""
    _both("dion", tmp_path)
    seen = [json.loads((tmp_path / f"dion{r}.json").read_text()) for r in (0, 1)]
    for s in seen:
        assert s["same"]["committed"] == s["first"]["committed"] == [True] * len(s["same"]["committed"]), s
        assert s["same"]["plain"] and s["same"]["sent"] > 0 and s["same"]["steps"] == len(s["same"]["committed"]), s
    a, b = (torch.load(tmp_path / f"dion-first{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    q = a["shared"]["compressors"]["override0"]["q"]  # Dion's group: the shared Q, no momenta
    assert q and not a["shared"]["compressors"]["override0"]["error"], a["shared"]["compressors"]
    assert _same(a["shared"]["compressors"], b["shared"]["compressors"]) and a["shared"]["step"] == b["shared"]["step"]


@pytest.mark.parametrize("what", ["hook", "layerwise", "planned", "adam", "dion"])
def test_a_killed_replica_skips_the_step_and_its_restart_heals_bit_for_bit(tmp_path, what):
    """The DDP hook (PowerSGD with a Top-k layer; Top-k with a layer-wise plan every step,
    so the killed step and the joiner's healing step plan; Top-k with one plan, at step 1,
    which the joiner, healing later, is handed before its buckets), 1-bit Adam killed
    past its warm-up (the momentum averaged in the backward pass), and Dion (its power
    iteration in the backward pass)."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=30000, heartbeat_timeout_ms=2000)
    meet = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    try:
        addr = lighthouse.address()
        survivor = _start(f"survivor-{what}", tmp_path, addr, meet.port, 0)
        killed = _start(f"killed-{what}", tmp_path, addr, meet.port, 1)
        _finish([killed])
        assert not (tmp_path / f"killed-{what}.json").exists()
        _when_alone(meet, [survivor])
        _finish([survivor, _start(f"joiner-{what}", tmp_path, addr, meet.port, 1)])
    finally:
        lighthouse.shutdown()
    seen = {name: json.loads((tmp_path / f"{name}-{what}.json").read_text()) for name in ("survivor", "joiner")}
    s, j = seen["survivor"], seen["joiner"]
    assert (s["failed_step_committed"], s["model_kept"], s["state_kept"]) == (False, True, True), s
    assert s["alone"] >= 1 and not s["healed"], s
    assert j["healed"] and j["step"] == s["step"], (s, j)
    assert s["commits"].count(False) == 1 and all(j["commits"]), (s, j)  # the killed step only; the heal too
    a, b = (torch.load(tmp_path / f"{n}-{what}.pt", weights_only=True) for n in ("survivor", "joiner"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    if what == "hook":
        lowrank = a["shared"]["compressors"]["main"]
        assert lowrank["q"] and not lowrank["error"]  # warm starts are shared, error feedback is not
    assert _same(a["shared"]["compressors"], b["shared"]["compressors"]) and a["shared"]["step"] == b["shared"]["step"]
    if what in ("layerwise", "planned"):
        plan = a["shared"]["layerwise"]
        assert plan["plan"]["step"] == (s["step"] - 1 if what == "layerwise" else 1), plan
        assert len(set(plan["plan"]["labels"].values())) > 1, plan  # tensors in several groups
        assert not plan["carry"] and not plan["measured"] and _same(plan, b["shared"]["layerwise"]), plan


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_the_bandwidth_layer_is_refused_under_a_manager():
    cfg = Config.load({"method": "powersgd", "bandwidth": {}})
    with pytest.raises(ConfigError, match=r"\[bandwidth\].*torchft Manager"):
        matrix.part_for(cfg, "DDP", managed=True)


def test_layerwise_under_a_manager_needs_the_model():
    cfg = {"method": "topk", "layerwise": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"\[layerwise\].*needs the model"):
        CommState(cfg, None, manager=object())


def test_torchfts_own_ddp_is_refused_with_the_wrapper_to_use():
    from torchft.ddp import DistributedDataParallel

    model = DistributedDataParallel(object(), torch.nn.Linear(4, 4))  # its hook's state: any object
    with pytest.raises(TypeError, match="managed_ddp"):
        commpress.register(model, {"method": "powersgd"}, manager=object())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_averaged_momentum_stops_the_managed_1bit_adam_step(bad):
    """The step's check covers every parameter in one host sync (the largest magnitude of
    each): a bad value in the last parameter, past an empty one, stops the step before
    AdamW's update touches any parameter."""
    from commpress.optim import InTheBackward, OneBitAdam

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(0)), torch.nn.Parameter(torch.ones(4))]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # a warm-up step: Adam's state for every parameter
    params[2].grad[1] = bad
    before = [p.detach().clone() for p in params]
    average = InTheBackward.__new__(InTheBackward)  # only what the step reads: step 7's momenta in p.grad
    average._step = 7
    onebit = OneBitAdam(opt, [(str(i), p) for i, p in enumerate(params)], average, 1)
    with pytest.raises(FloatingPointError, match="round 7 is not finite"):
        onebit._pre_step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
