"""Local ranks on torch's elastic launcher: results in rank order, a failing rank reported as
torchrun reports it (rank, exit code, traceback), a stuck rank ended by the deadline."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from commpress.comm.launch import run_local

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
