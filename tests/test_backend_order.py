"""The ordered-channel backend: every rank issues the same collectives in the same order,
with several multi-round reductions in flight and callbacks completing on other threads."""

from __future__ import annotations

import random
import threading
import time

import multiround  # noqa: F401  (registers test-multiround)
import pytest
import torch

from commpress.bench.launch import run_local
from commpress.comm.backend import Backend
from commpress.compressors import AllGather, AllReduce, Bucket, Context, build


class _ShuffledBackend(Backend):
    """Completes every collective on a new thread after a random delay and records, per
    channel, the order in which requests were issued."""

    def __init__(self, rounds: int, seed: int) -> None:
        super().__init__(rank=0, world_size=1, rounds=rounds)
        self.issued: list[list[str]] = [[] for _ in range(rounds)]
        self.rng = random.Random(seed)

    def allgather_object(self, obj):
        return [obj]

    def members(self, scope):
        return [0]

    def _start(self, channel, request):
        self.issued[channel[1]].append(request.tag)
        fut = torch.futures.Future()
        delay = self.rng.random() * 0.004
        value = request.tensor if isinstance(request, AllReduce) else [request.tensor]

        def complete():
            time.sleep(delay)
            fut.set_result(value)

        threading.Thread(target=complete).start()
        return fut


def _reduction(bucket: int, rounds: int):
    for r in range(rounds):
        time.sleep(random.random() * 0.002)
        req = AllReduce(torch.ones(1)) if r % 2 == 0 else AllGather(torch.ones(2))
        req.tag = f"b{bucket}r{r}"
        yield req
    return bucket  # what the future completes with


@pytest.mark.parametrize("seed", range(5))
def test_channels_issue_in_bucket_order_whatever_the_completion_order(seed):
    random.seed(seed)
    backend = _ShuffledBackend(rounds=3, seed=seed)
    rounds_of = {b: 1 + (b * 7 + seed) % 3 for b in range(12)}  # some buckets skip later rounds
    futures = [backend.run(_reduction(b, rounds_of[b])) for b in range(12)]
    assert [f.wait() for f in futures] == list(range(12))
    for r in range(3):
        expected = [f"b{b}r{r}" for b in range(12) if rounds_of[b] > r]
        assert backend.issued[r] == expected


def test_too_many_rounds_and_bad_yields_fail_the_future():
    backend = _ShuffledBackend(rounds=1, seed=0)
    with pytest.raises(RuntimeError, match="more than 1 collectives"):
        backend.run(_reduction(0, 2)).wait()

    def not_a_collective():
        yield "hello"

    with pytest.raises(TypeError, match="yielded str, not a collective"):
        backend.run(not_a_collective()).wait()
    # a failed reduction releases its turns: the next one still runs
    assert backend.run(_reduction(1, 1)).wait() == 1  # the reduction's return value


def test_compressor_exception_reaches_the_future():
    backend = _ShuffledBackend(rounds=1, seed=0)
    bucket = Bucket(0, torch.arange(3, dtype=torch.int64))
    fut = backend.run(build("none").reduce(bucket, Context(0, 1, 0)))
    with pytest.raises(TypeError, match="int64"):
        fut.wait()


def _many_buckets_many_steps(rank: int, world: int, steps: int) -> list[float]:
    """DDP with tiny buckets and the 3-round test compressor; gradients must equal the
    plain average (checked against a no-hook replica of the same model)."""
    from torch.nn.parallel import DistributedDataParallel

    from commpress import register

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    ref = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    ref.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)  # ~16 KB each: many buckets
    ddp_ref = DistributedDataParallel(ref, bucket_cap_mb=0.02)
    register(ddp, {"method": "test-multiround"})
    errors = []
    for step in range(steps):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step * 100 + rank))
        for m in (ddp, ddp_ref):
            m.zero_grad()
            m(x).square().mean().backward()
        errors.append(max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
    return errors


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_multi_round_compressor_over_gloo_with_many_buckets(world):
    results = run_local(_many_buckets_many_steps, world, 25)
    for errors in results:
        # divide-then-sum vs DDP's own divide-then-sum on the same values: equal up to
        # summation order inside gloo (a few ulps of ~1e-2 gradients).
        assert max(errors) < 1e-6
