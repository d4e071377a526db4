"""Part ``fsdp``: QSDP (8-bit weights and gradients) on FSDP2 on CUDA, one NCCL rank,
beside the same run on one gloo CPU rank.

:func:`commpress.workloads.train_fsdp.train_fsdp` trains the demo model both times. The
weights differ by the rounding of the forward on either device, and stochastic rounding
of weights then sees other inputs, so the losses agree within :data:`RTOL`, not exactly.
``--dry``: the CPU run only, smaller.
"""

from __future__ import annotations

from typing import Any

from commpress.bench.gpucheck.part import Report, cuda_against_cpu, main

QSDP = {"weight_bits": 8, "grad_bits": 8}
RTOL = 0.05
#: (steps, hidden width) on the GPU (False) and in a dry run (True)
SIZES = {False: (30, 512), True: (3, 64)}


def run(report: Report, dry: bool) -> None:
    from commpress.workloads.train_fsdp import train_fsdp

    steps, hidden = SIZES[dry]

    def train(device: str) -> tuple[list[float], float, dict[str, Any]]:
        result = train_fsdp(QSDP, steps=steps, hidden=hidden, device=device)
        return result.losses, result.eval_loss, {"step_ms": result.step_seconds * 1e3, "traffic_per_step": result.traffic}

    cuda_against_cpu(report, "", train, dry, RTOL, what="QSDP")


if __name__ == "__main__":
    main("fsdp", run)
