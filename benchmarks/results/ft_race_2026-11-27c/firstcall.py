"""A fresh process's first TernGrad reductions (the CPU kernels loaded from numba's cache) against later ones."""
import time
t0 = time.perf_counter()
import torch
from commpress.comm import SimulatedWorld
from commpress.comm.averager import ParameterAverager
from commpress.compressors import Bucket, lay_out
t1 = time.perf_counter()
torch.set_num_threads(1)
numel = 3_240_000
slots, n = lay_out([("w", (numel,))])
backend = SimulatedWorld(1).backends[0]
avg = ParameterAverager("terngrad", backend=backend)
times = []
for i in range(6):
    buf = torch.randn(n)
    t = time.perf_counter()
    avg.start(Bucket(0, buf, slots)).wait()
    times.append(round(1000 * (time.perf_counter() - t), 1))
print(f"imports {1000*(t1-t0):.0f} ms; reductions (ms): {times}")
