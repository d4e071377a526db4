"""TernGrad's reduction of a gradient of 4,200,448 Gaussian values (transformer-like
tensor sizes) on a simulated world of 2, with and without entropy coding:
milliseconds per rank (the world runs both ranks in this thread), bytes per rank, bits a value.
python coding_cost.py"""

import statistics
import time

import torch

from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build

SIZES = [4_096 * 256] + [256 * 768, 256 * 256, 256 * 1024, 1024 * 256] * 4 + [256] * 24  # about 3.2M


def run(entropy: bool, reps: int = 9) -> tuple[float, float]:
    times, sent = [], 0
    for step in range(reps):
        g = torch.Generator().manual_seed(step)
        buckets = [Bucket.from_tensors(0, [torch.randn(n, generator=g) for n in SIZES], [f"t{i}" for i in range(len(SIZES))]) for _ in range(2)]
        sim = SimulatedWorld(2)
        comps = sim.compressors(lambda: build("terngrad", {"entropy": entropy}))
        t0 = time.perf_counter()
        sim.reduce(comps, buckets, step=step)
        times.append((time.perf_counter() - t0) / 2 * 1e3)
        sent = sim.traffic[0].bytes_sent
    return statistics.median(times), sent


if __name__ == "__main__":
    n = sum(SIZES)
    for entropy in (False, True, False, True):
        ms, sent = run(entropy)
        print(f"entropy={entropy!s:5}  {ms:6.1f} ms per rank  {sent:,} bytes per rank  {8 * sent / n:.3f} bits a value")
