"""A test-only compressor with several rounds of mixed collectives, used to check that
backends issue rounds in the same order on every rank."""

from __future__ import annotations

import random
import time
from typing import ClassVar

import torch

from commpress.compressors import AllGather, AllReduce, Bucket, Compressor, Context, Reduction, register_compressor


@register_compressor
class MultiRound(Compressor):
    """Round 1: all-reduce the pre-divided buffer. Round 2: all-gather of a rank- and
    bucket-dependent vector (its size depends on the bucket). Round 3 (odd bucket indices only): max all-reduce of the step.
    Random sleeps between rounds shuffle the timing of completion callbacks."""

    name: ClassVar[str] = "test-multiround"
    rounds: ClassVar[int] = 3

    def __init__(self, jitter: float = 0.003) -> None:
        self.jitter = jitter

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        rng = random.Random(hash((ctx.rank, ctx.step, bucket.index, time.perf_counter_ns())))
        time.sleep(rng.random() * self.jitter)
        total = yield AllReduce(bucket.buffer.div(ctx.world_size))
        time.sleep(rng.random() * self.jitter)
        size = bucket.index % 3 + 1  # buckets differ: a mixed-up order shows as a size mismatch
        mine = torch.full((size,), float(bucket.index * 1000 + ctx.rank))
        gathered = yield AllGather(mine)
        expected = [torch.full((size,), float(bucket.index * 1000 + r)) for r in range(ctx.world_size)]
        if len(gathered) != ctx.world_size or not all(torch.equal(a, b) for a, b in zip(gathered, expected)):
            raise AssertionError(f"bucket {bucket.index}: gathered {gathered}, expected {expected}")
        if bucket.index % 2:
            time.sleep(rng.random() * self.jitter)
            peak = yield AllReduce(torch.tensor([float(ctx.step * 10 + ctx.rank)]), op="max")
            if peak.item() != ctx.step * 10 + ctx.world_size - 1:
                raise AssertionError(f"max all-reduce gave {peak.item()}")
        bucket.buffer.copy_(total)
