import statistics, time, sys, torch
torch.set_num_threads(1)
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build
from commpress.workloads.synthetic import CharTransformerTask
import commpress; print(commpress.__file__)
SIZES = [p.numel() for p in CharTransformerTask(context=64, width=256, layers=4, heads=4).model().parameters()]
def reduction_ms(world, entropy, rounds=9):
    times = []; names = [f"t{i}" for i in range(len(SIZES))]
    for step in range(rounds + 1):
        g = torch.Generator().manual_seed(step)
        buckets = [Bucket.from_tensors(0, [torch.randn(n, generator=g) for n in SIZES], names) for _ in range(world)]
        sim = SimulatedWorld(world)
        comps = sim.compressors(lambda: build("terngrad", {"entropy": entropy}))
        t0 = time.perf_counter(); sim.reduce(comps, buckets, step=step)
        if step: times.append((time.perf_counter() - t0) / world * 1e3)
    return statistics.median(times), sim.traffic[0].bytes_sent
for w in (2, 3):
    print(w, 'plain %.1f ms' % reduction_ms(w, False)[0], 'coded %.1f ms %d bytes' % reduction_ms(w, True))
