"""Local ranks on torch's elastic launcher: results in rank order, a failing rank reported as
torchrun reports it (rank, exit code, traceback), a stuck rank ended by the deadline; ranks
forked from the fork server see the launcher's environment, and a launch whose import-time
variables differ from the server's is spawned."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from commpress.bench import launch
from commpress.bench.launch import run_local

pytestmark = pytest.mark.multiproc


def _sum_of_ranks(rank: int, world: int, how: str) -> tuple[int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    if how == "raise" and rank == 1:
        raise ValueError("rank 1 refuses")
    if how == "stall" and rank == 1:
        time.sleep(3600)
    return rank, t.item()


def test_results_come_back_in_rank_order():
    assert run_local(_sum_of_ranks, 3, "return") == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_a_failing_rank_is_named_with_its_exit_code_and_traceback():
    with pytest.raises(ChildFailedError) as info:
        run_local(_sum_of_ranks, 2, "raise")
    ((rank, failure),) = info.value.failures.items()
    assert rank == 1 and failure.exitcode == 1
    assert "ValueError: rank 1 refuses" in str(info.value)


def test_a_stuck_rank_ends_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(ChildFailedError) as info:
        run_local(_sum_of_ranks, 2, "stall", timeout=15.0)
    assert time.monotonic() - start < 600  # the rank sleeps for an hour
    ((rank, failure),) = info.value.failures.items()
    assert rank == 1 and failure.exitcode == 1


def _environment_and_parent(rank: int, world: int, names: tuple[str, ...]) -> tuple[dict[str, str | None], int]:
    return {name: os.environ.get(name) for name in names}, os.getppid()


def test_forked_ranks_see_the_launchers_environment_and_other_import_time_variables_spawn(monkeypatch):
    names = ("LAUNCH_TEST_LATE", "RANK", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
    run_local(_sum_of_ranks, 2, "return")  # the fork server runs from here on
    monkeypatch.setenv("LAUNCH_TEST_LATE", "set after the server started")
    forked = run_local(_environment_and_parent, 2, names)
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # libgomp reads it when torch loads
    spawned = run_local(_environment_and_parent, 2, names)
    late = "set after the server started"
    assert [env for env, _ in forked] == [
        {"LAUNCH_TEST_LATE": late, "RANK": str(r), "GOMP_SPINCOUNT": "10000", "OMP_WAIT_POLICY": None} for r in range(2)
    ]
    assert [env for env, _ in spawned] == [
        {"LAUNCH_TEST_LATE": late, "RANK": str(r), "GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "passive"} for r in range(2)
    ]
    if launch._server_env is not None:  # a platform with a fork server
        assert all(parent != os.getpid() for _, parent in forked)  # forked by the server
        assert all(parent == os.getpid() for _, parent in spawned)  # spawned by this process


def _print_rank(rank: int, world: int) -> None:
    print(f"rank {rank} of {world} on stdout", flush=True)
    print(f"rank {rank} of {world} on stderr", file=sys.stderr, flush=True)


def test_ranks_print_where_the_launcher_prints_now(capfd):
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        for fd in (1, 2):
            os.dup2(null.fileno(), fd)
        try:
            run_local(_sum_of_ranks, 2, "return")  # a fork server started now keeps /dev/null
        finally:
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
    run_local(_print_rank, 2)
    out, err = capfd.readouterr()
    assert all(f"rank {r} of 2 on stdout" in out and f"rank {r} of 2 on stderr" in err for r in range(2)), (out, err)
