"""Part ``fsdp``: QSDP (8-bit weights and gradients) on FSDP2 on CUDA, one NCCL rank,
beside the same run on one gloo CPU rank.

:func:`commpress.workloads.train_fsdp.train_fsdp` trains the demo model both times. The
weights differ by the rounding of the forward on either device, and stochastic rounding
of weights then sees other inputs, so the losses agree within :data:`RTOL`, not exactly.
``--dry``: the CPU run only, smaller.
"""

from __future__ import annotations

import math

from commpress.bench.gpucheck.part import Report, main, no_cuda, one_rank

QSDP = {"weight_bits": 8, "grad_bits": 8}
RTOL = 0.05
#: (steps, hidden width) on the GPU (False) and in a dry run (True)
SIZES = {False: (30, 512), True: (3, 64)}


def run(report: Report, dry: bool) -> None:
    from commpress.workloads.train_fsdp import train_fsdp

    steps, hidden = SIZES[dry]
    reason = no_cuda(dry)
    runs = {}
    # the CUDA run first: were a second process group in this process to fail, it is the one kept
    for name, device, backend in (("cuda-nccl-1", "cuda", "nccl"), ("cpu-gloo-1", "cpu", "gloo")):
        if device == "cuda" and reason is not None:
            report.skip(name, reason)
            continue
        with one_rank(backend):
            result = train_fsdp(QSDP, steps=steps, hidden=hidden, device=device)
        runs[name] = result
        report.ran.append(name)
        report.figures[name] = {
            "losses": result.losses,
            "eval_loss": result.eval_loss,
            "step_ms": result.step_seconds * 1e3,
            "traffic_per_step": result.traffic,
        }
        finite = all(map(math.isfinite, [*result.losses, result.eval_loss]))
        report.check(f"{name}: QSDP trains (finite losses)", finite)
        if not dry:
            first, last = result.losses[0], result.losses[-1]
            report.check(f"{name}: the loss falls", last < first, first=first, last=last)
    if "cuda-nccl-1" in runs:
        cpu, gpu = runs["cpu-gloo-1"], runs["cuda-nccl-1"]
        worst = max(abs(a - b) / abs(a) for a, b in zip([*cpu.losses, cpu.eval_loss], [*gpu.losses, gpu.eval_loss]))
        report.check(f"cuda-nccl-1 losses within {RTOL:.0%} of cpu-gloo-1's", worst <= RTOL, largest_relative=worst)
    else:
        report.skip("cuda-nccl-1 against cpu-gloo-1", reason or "not run")


if __name__ == "__main__":
    main("fsdp", run)
