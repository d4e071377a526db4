"""One optimizer step on the race's transformer, one thread: torch.optim.Muon (its
Newton-Schulz in bfloat16), the benchmarks' Float32Muon, and AdamW; median of 3 steps.
python benchmarks/results/muon_2026-12-02/step_time.py"""

import statistics
import time

import torch

from commpress.bench.optimizers import Float32Muon, muon_split
from commpress.bench.race import RaceTask

torch.set_num_threads(1)
model = RaceTask().data().model()
for p in model.parameters():
    p.grad = torch.randn_like(p)
matrices, _ = muon_split(model)
for name, opt in (
    ("torch.optim.Muon", torch.optim.Muon(matrices, adjust_lr_fn="match_rms_adamw")),
    ("Float32Muon", Float32Muon(matrices, adjust_lr_fn="match_rms_adamw")),
    ("AdamW (every parameter)", torch.optim.AdamW(model.parameters())),
):
    times = []
    for _ in range(3):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    print(f"{name:<26} {statistics.median(times):8.3f} s a step")
