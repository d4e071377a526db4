"""The backend over a torchft Manager, in one process: a stand-in manager whose group holds
one scripted peer. A healing replica's all-reduce input is zeroed and its all-gather entry
left out (the participation byte), whatever the dtype; a failure reaches the manager."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch.distributed import ReduceOp

from commpress.comm.manager_backend import ManagerBackend, replay, report
from commpress.compressors import AllGather, AllReduce
from commpress.errors import CollectiveError


class _Group:
    """Two replicas: this one and a peer that sends ``peer`` and says ``peer_in``."""

    def __init__(self, peer: torch.Tensor, peer_in: bool, fail: bool = False) -> None:
        self.peer, self.peer_in, self.fail = peer, peer_in, fail

    def size(self) -> int:
        return 2

    def _done(self):
        fut = torch.futures.Future()
        if self.fail:
            fut.set_exception(RuntimeError("Connection reset by peer"))
        else:
            fut.set_result(None)
        return type("Work", (), {"get_future": lambda _: fut})()

    def allreduce(self, tensors, opts):
        if opts.reduceOp == ReduceOp.MAX:
            torch.maximum(tensors[0], self.peer.to(tensors[0].dtype), out=tensors[0])
        else:
            tensors[0].add_(self.peer)
        return self._done()

    def allgather(self, outputs, inputs, opts):
        raw = torch.cat([self.peer.reshape(-1).view(torch.uint8), torch.tensor([int(self.peer_in)], dtype=torch.uint8)])
        outputs[0][0].copy_(inputs[0])
        outputs[0][1].copy_(raw)
        return self._done()


class _Manager:
    _timeout = timedelta(seconds=60)

    def __init__(self, group: _Group, participating: bool, participants: int) -> None:
        self._pg, self.participating, self.participants, self.error = group, participating, participants, None

    def current_step(self) -> int:
        return 3

    def num_participants(self) -> int:
        return self.participants

    def is_participating(self) -> bool:
        return self.participating

    def participating_rank(self) -> int | None:
        return 0 if self.participating else None

    def errored(self):
        return self.error

    def report_error(self, exc: Exception) -> None:
        self.error = exc


def _once(request):
    result = yield request
    return result


def _backend(peer: torch.Tensor, peer_in: bool, me_in: bool, fail: bool = False) -> ManagerBackend:
    backend = ManagerBackend(_Manager(_Group(peer, peer_in, fail), me_in, int(me_in) + int(peer_in)), rounds=1)
    backend.begin_step()
    return backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.uint8])
@pytest.mark.parametrize(("me_in", "peer_in"), [(True, True), (True, False), (False, True)])
def test_all_gather_leaves_out_whoever_heals(dtype, me_in, peer_in):
    mine, peer = torch.arange(5).to(dtype), torch.arange(10, 15).to(dtype)
    backend = _backend(peer, peer_in, me_in)
    got = backend.run(_once(AllGather(mine))).wait()
    expected = [t for t, inside in ((mine, me_in), (peer, peer_in)) if inside]
    assert len(got) == len(expected) and all(torch.equal(g, e) for g, e in zip(got, expected))
    assert backend.world_size == len(expected)


def test_a_healing_replica_sends_zeros_in_an_all_reduce_and_its_log_replays():
    backend = _backend(torch.full((4,), 2.0), peer_in=True, me_in=False)
    got = backend.run(_once(AllReduce(torch.full((4,), 5.0)))).wait()
    assert torch.equal(got, torch.full((4,), 2.0))  # the peer's alone
    assert backend.log is not None and torch.equal(backend.log[0][0], got)
    again = replay(_once(AllReduce(torch.zeros(4))), backend.log[0])
    assert torch.equal(again, got)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_a_healing_replica_counts_as_nothing_in_a_maximum(dtype):
    """Zero is no identity for a maximum: a healing replica sends the lowest value, so the
    peers' maximum comes back even where every peer's value is below zero."""
    backend = _backend(torch.full((2,), -3).to(dtype), peer_in=True, me_in=False)
    got = backend.run(_once(AllReduce(torch.full((2,), 7).to(dtype), op="max"))).wait()
    assert torch.equal(got, torch.full((2,), -3).to(dtype))


def test_a_failed_collective_fails_the_reduction_and_reaches_the_manager():
    backend = _backend(torch.zeros(3), peer_in=True, me_in=True, fail=True)
    with pytest.raises(Exception, match="Connection reset"):
        backend.run(_once(AllReduce(torch.ones(3)))).wait()
    assert backend.manager.errored() is not None
    backend.begin_step()  # the next step starts clean; the manager still refuses until its next quorum
    with pytest.raises(Exception, match="already failed this step"):
        backend.run(_once(AllReduce(torch.ones(3)))).wait()


def test_a_lost_collective_logs_one_line_and_a_failure_retrying_will_not_cure_its_traceback(caplog):
    """A lost peer's error reaches :func:`report` raised in a future's callback (a
    RuntimeError whose text names the CollectiveError): one WARNING line, no traceback."""
    reported = []
    manager = _Manager(_Group(torch.zeros(1), True), True, 2)
    manager.report_error = reported.append
    fut = torch.futures.Future()
    fut.set_result(None)

    def lost(_):
        raise CollectiveError("all_reduce failed: Connection reset by peer")

    try:
        fut.then(lost).wait()
    except RuntimeError as exc:
        wrapped = exc
    with caplog.at_level("WARNING", logger="commpress.manager"):
        report(manager, CollectiveError("a peer was lost"))
        report(manager, wrapped)
        report(manager, FloatingPointError("the average is not finite"))
        assert [(r.levelname, r.exc_info) for r in caplog.records] == [("WARNING", None)] * 3
        assert [r.getMessage() for r in caplog.records] == [
            "step 3 will not be committed: a peer was lost",
            "step 3 will not be committed: CollectiveError: all_reduce failed: Connection reset by peer",
            "step 3 will not be committed: the average is not finite",
        ]
        caplog.clear()
        report(manager, ValueError("a bad bucket"))
    assert [type(e) for e in reported] == [CollectiveError, RuntimeError, FloatingPointError, ValueError]
    (record,) = caplog.records
    assert record.levelname == "ERROR" and "a bad bucket" in record.getMessage() and record.exc_info[0] is ValueError
