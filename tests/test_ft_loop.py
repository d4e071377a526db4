"""The DiLoCo loop of docs/fault_tolerance.md, as written there, through a kill and an
immediate restart (CPU, gloo, the lighthouse in this process, replica groups as processes:
tests/ft_loop_workers.py).

Three replica groups train docs/configs/slow-link.toml under a torchft Manager; one is
SIGKILLed with a sync in flight and started again as soon as it has exited, as an operator
or an elastic launcher does; it joins at once and heals from a peer. Every replica then
ends at the job's step with the same model, bit for bit: the loop runs to the job's step
(``reg.local_sgd.job_step``, which the restarted replica takes from its peers when it
heals), not over a fixed number of batches per process. With ``for batch in
itertools.islice(data, TOTAL_STEPS)`` in its place the restarted replica trains on alone
after its peers have finished and ends with another model (this test then fails). With
Muon + AdamW (two optimizers, one iteration) the same holds.
"""

from __future__ import annotations

import signal

import pytest
import torch

pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

from ft_loop_workers import GATE, KILL_STEP, TOTAL_STEPS
from test_manager import _finish, _log, _start
from torch.distributed import TCPStore
from torchft.coordination import LighthouseServer

pytestmark = pytest.mark.multiproc
WORKERS = "ft_loop_workers.py"
WAIT = 600  # seconds, for processes expected to end within a minute


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_documented_diloco_loop_ends_every_replica_at_the_jobs_step_with_one_model(tmp_path, optimizer):
    # join timeout: the lighthouse waits this long for a heartbeating replica that has not
    # joined yet (a restarted one loading its kernels); heartbeat timeout: a killed one is
    # declared lost after 2 s, as on the page
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60000, heartbeat_timeout_ms=2000)
    meet = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    meet.set("optimizer", optimizer)  # the page's AdamW, or Muon + AdamW (register(optimizer=[muon, adamw]))
    try:
        addr = lighthouse.address()
        procs = [_start("start", tmp_path, addr, meet.port, r, WORKERS) for r in (0, 1, 2)]
        victim = procs.pop()
        victim.wait(timeout=WAIT)
        assert victim.returncode == -signal.SIGKILL, _log(victim)
        procs.append(_start("restarted", tmp_path, addr, meet.port, 2, WORKERS))  # at once
        _finish(procs, timeout=WAIT)
    finally:
        lighthouse.shutdown()

    names = ("start0", "start1", "restarted2")
    seen = {n: torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in names}
    for name, s in seen.items():
        assert s["job_step"] == TOTAL_STEPS, (name, s["job_step"], s["drawn"])
        assert s["manager_step"] == seen["start0"]["manager_step"], {n: t["manager_step"] for n, t in seen.items()}
    for name in ("start0", "start1"):  # every step of the job once, through the kill
        assert seen[name]["drawn"] == list(range(TOTAL_STEPS)), (name, seen[name]["drawn"])
    drawn = seen["restarted2"]["drawn"]
    # its first round and the step its first sync lands after (sync_delay 1) on its own
    # count, then the job's: it healed mid-job, after the kill, and took the job's step
    assert drawn[:3] == [0, 1, 2] and KILL_STEP < drawn[3] <= GATE + 2, drawn
    assert drawn[3:] == list(range(drawn[3], TOTAL_STEPS)), drawn
    models = [seen[n]["model"] for n in names]
    for model in models[1:]:
        assert all(torch.equal(model[k], models[0][k]) for k in models[0]), "the replicas ended with different models"
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).state_dict()
    assert not torch.equal(initial["0.weight"], models[0]["0.weight"])  # it trained
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in names}
    for name in ("start0", "start1"):  # the sync the kill broke was not committed, and said so in one line
        assert seen[name]["commits"].count(False) >= 1, (name, seen[name]["commits"])
        lost = [line for line in logs[name].splitlines() if line.startswith("commpress.manager WARNING step")]
        assert 1 <= len(lost) <= seen[name]["commits"].count(False), (name, lost)
    for name in names:  # finish() synced with every replica: no warning that it did not
        assert "finish() at step" not in logs[name], name
