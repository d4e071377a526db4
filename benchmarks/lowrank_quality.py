"""Why ACP-SGD trains worse than PowerSGD at the same rank on the demo: what each one delivers.

Trains the demo model (``commpress demo``'s task, SGD momentum 0.9, cosine lr from 0.2,
batch 64 per rank) on 2 ranks simulated in one process, with the real compressors on
``SimulatedWorld``. Every step it compares the gradient a method delivers (``A``, the
averaged low-rank result) with the exact average of the ranks' gradients (``G``) over all
compressed matrices: the norm ratio ``|A|/|G|`` (1 = the right amount of gradient, above 1
= stored error released in a burst) and the cosine between them (1 = the right direction).
The table shows their medians and worst values per window of steps, and the held-out loss
at the end with its gap to plain averaging on the same seed.

    PYTHONPATH=. python benchmarks/lowrank_quality.py --rank 4 --start-iter 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build
from commpress.compressors.lowrank_plan import LowRankPlan
from commpress.terminal import format_table
from commpress.workloads.charlm import CharTask
from commpress.workloads.train import cosine_lr

WORLD = 2


def train(method: str, rank: int, steps: int, start_iter: int, window: int) -> tuple[float, list[list[str]]]:
    """One closed-loop run; returns (held-out loss, table rows per window)."""
    task = CharTask(batch_size=64)
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    schedule = cosine_lr(0.2, steps)
    names, params = zip(*model.named_parameters())
    sim = SimulatedWorld(WORLD)
    params_of_method = {"rank": rank} if method != "none" else {}
    comps = sim.compressors(lambda: build(method, params_of_method))
    plain = sim.compressors(lambda: build("none"))
    stats: list[tuple[float, float]] = []
    losses: list[float] = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        grads = []
        for r in range(WORLD):
            x, y = task.batch(step, r, WORLD)
            loss = F.cross_entropy(model(x), y)
            grads.append(torch.autograd.grad(loss, params))
            losses.append(loss.item())
        buckets = [Bucket.from_tensors(0, g, names) for g in grads]
        exact = sum(b.buffer for b in buckets) / WORLD
        sim.reduce(comps if step >= start_iter else plain, buckets, step)
        for c in comps:
            c.end_step(True)
        delivered = buckets[0].buffer
        if method != "none" and step >= start_iter:
            mask = _compressed_mask(buckets[0], rank)
            a, g = delivered[mask], exact[mask]
            stats.append((float(a.norm() / g.norm()), float(F.cosine_similarity(a, g, dim=0))))
        for p, v in zip(params, buckets[0].views()):
            p.grad = v.clone()
        opt.step()
    xe, ye = task.eval_batch()
    with torch.no_grad():
        eval_loss = F.cross_entropy(model(xe), ye).item()
    rows = []
    for begin in range(start_iter, steps, window):
        chunk = stats[begin - start_iter : begin - start_iter + window]
        if not chunk:
            continue
        norms, cosines = zip(*chunk)
        rows.append(
            [
                method,
                f"{begin}-{begin + len(chunk) - 1}",
                f"{statistics.median(norms):.2f}",
                f"{max(norms):.2f}",
                f"{statistics.median(cosines):.2f}",
                f"{min(cosines):.2f}",
                f"{statistics.mean(losses[2 * begin : 2 * (begin + len(chunk))]):.3f}",
            ]
        )
    return eval_loss, rows


def _compressed_mask(bucket: Bucket, rank: int) -> torch.Tensor:
    """True at the elements the low-rank plan compresses (the rest is averaged exactly)."""
    mask = torch.ones(bucket.buffer.numel(), dtype=torch.bool)
    mask[LowRankPlan.build(tuple(bucket.slots), rank, 2.0).dense_index] = False
    return mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--start-iter", type=int, default=20, help="plain averaging before this step (default 20)")
    parser.add_argument("--window", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    ref, _ = train("none", args.rank, args.steps, args.start_iter, args.window)
    table, finals = [], []
    for method in ("powersgd", "acpsgd"):
        loss, rows = train(method, args.rank, args.steps, args.start_iter, args.window)
        table += rows
        finals.append([method, f"{loss:.4f}", f"{100 * (loss - ref) / ref:+.2f}%"])
    print(f"2 simulated ranks, rank {args.rank}, start_iter {args.start_iter}, {args.steps} steps; none: {ref:.4f}")
    print(format_table(["method", "final loss", "gap vs none"], finals))
    print()
    headers = ["method", "steps", "median |A|/|G|", "max |A|/|G|", "median cos", "min cos", "train loss"]
    print(format_table(headers, table))


if __name__ == "__main__":
    main()
