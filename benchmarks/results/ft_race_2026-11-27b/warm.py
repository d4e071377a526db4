"""Step times of a fresh process: the race's transformer, AdamW, one thread, 80 steps.

    python benchmarks/results/ft_race_2026-11-27b/warm.py   # its output: warm.out
"""

import time

import torch

from commpress.bench.race import RaceTask

torch.set_num_threads(1)
task = RaceTask()
data = task.data()
model = data.model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
times = []
for step in range(80):
    x, y = data.batch(step, 0, 3)
    start = time.perf_counter()
    RaceTask.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
print(" ".join(f"{t * 1000:.0f}" for t in times))
print(f"first10 {sum(times[:10]) * 100:.0f}  10-30 {sum(times[10:30]) * 50:.0f}  last40 {sum(times[40:]) * 25:.0f}")
