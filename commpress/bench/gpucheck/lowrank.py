"""Part ``lowrank``: PowerSGD, ACP-SGD, TernGrad and Top-k per step on GPT-2-small's gradient
shapes, beside PyTorch's ``powerSGD_hook`` and plain DDP on the same GPU.

One NCCL rank, so the all-reduces cost next to nothing and a row's step time over plain
DDP's is what its compression costs; ``commpress bench``'s runner
(:func:`commpress.bench.runner.bench_rank`) measures the rows, every step waiting for the
GPU. On the GPU the issue's bounds are checked (:data:`BOUNDS`): commpress's low-rank rows
cost no more over DDP than PyTorch's hook, TernGrad and Top-k at most 1.2x PowerSGD.
``--dry``: the same rows on one gloo CPU rank at a small scale, unjudged.
"""

from __future__ import annotations

import statistics
from typing import Any

from commpress.bench.gpucheck.part import Report, main, no_cuda, one_rank

METHODS = "ddp;torch-powersgd:rank=4;powersgd:rank=4;acpsgd:rank=4;terngrad;topk:ratio=0.01"
#: row -> (the row whose time over DDP bounds it, the factor)
BOUNDS = {
    "powersgd:rank=4": ("torch-powersgd:rank=4", 1.0),
    "acpsgd:rank=4": ("torch-powersgd:rank=4", 1.0),
    "terngrad": ("powersgd:rank=4", 1.2),
    "topk:ratio=0.01": ("powersgd:rank=4", 1.2),
}
#: (GPT-2 scale, gradient rank, warm-up steps, timed steps) on the GPU (False) and dry (True)
SIZES = {False: (1.0, 8, 3, 10), True: (0.005, 4, 2, 2)}


def rows(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per row: median step ms, ms over plain DDP's, ms inside commpress's compressors per
    step, bytes sent per step."""
    methods = result["ranks"][0]["methods"]
    steps = result["steps"]
    median = {m["label"]: statistics.median(m["step_seconds"]) * 1e3 for m in methods}
    base = median.get("ddp", 0.0)
    return {
        m["label"]: {
            "step_ms": median[m["label"]],
            "over_ddp_ms": median[m["label"]] - base,
            "compressor_ms": m["compute_seconds"] / steps * 1e3,
            "bytes_per_step": m["bytes_sent"] / steps,
        }
        for m in methods
    }


def run(report: Report, dry: bool) -> None:
    from commpress.bench.methods import parse_methods
    from commpress.bench.runner import BenchPlan, bench_rank

    reason = no_cuda(dry)
    if reason is not None:
        report.skip("the rows on a GPU (NCCL)", reason)
    device, backend = ("cpu", "gloo") if reason else ("cuda", "nccl")
    scale, batch, warmup, steps = SIZES[dry]
    plan = BenchPlan(
        methods=tuple(parse_methods(METHODS)),
        scale=scale,
        batch=batch,
        steps=steps,
        warmup=warmup,
        progress=False,
        device=device,
    )
    with one_rank(backend):
        result = bench_rank(0, 1, plan)
    report.ran.append(f"{device} rows")
    table = rows(result)
    report.figures.update({"device": device, "workload": result["workload"], "rows": table})
    for label, row in table.items():
        print(f"[lowrank] {label:<22} {row['step_ms']:9.2f} ms/step  {row['over_ddp_ms']:+9.2f} ms over ddp", flush=True)
    report.check("every row ran", set(table) == {m.label for m in plan.methods}, rows=sorted(table))
    if reason is None:
        for label, (bound, factor) in BOUNDS.items():
            mine, theirs = table[label]["over_ddp_ms"], table[bound]["over_ddp_ms"]
            report.check(f"{label} over DDP <= {factor:g}x {bound}'s", mine <= factor * theirs, ms=mine, bound_ms=theirs)


if __name__ == "__main__":
    main("lowrank", run)
