"""Part ``kernels``: every kernel's throughput beside a device-to-device copy, on the GPU
judged against its byte limit (:data:`commpress.bench.kernels.BYTES`).

An op at 100% of its byte limit moves its bytes as fast as the copy of the same run moves
its own; the target is :data:`TARGET` for every op but the copy. 25M-element gradients
(24 Mi float32) on the GPU, each round ten calls back to back; ``--dry`` runs the same
table on the CPU at 64 Ki elements, where nothing is judged.
"""

from __future__ import annotations

import torch

from commpress.bench import kernels as bench
from commpress.bench.gpucheck.part import Report, main, no_cuda

TARGET = 0.70
#: (elements, rounds, calls per round) on the GPU (False) and in a dry run (True)
SIZES = {False: (24 << 20, 7, 10), True: (1 << 16, 2, 1)}


def run(report: Report, dry: bool) -> None:
    reason = no_cuda(dry)
    device = torch.device("cpu" if reason else "cuda")
    numel, repeat, inner = SIZES[dry]
    rows = bench.measure(numel, device, repeat, inner)
    report.ran.append(f"{device.type} table")
    report.figures.update({"device": device.type, "numel": numel, "rounds": repeat, "inner": inner, "rows": rows})
    print(bench.table(rows), flush=True)
    if reason is not None:
        report.skip(f"the {TARGET:.0%} byte-limit target on the GPU", reason)
        return
    for row in rows[1:]:
        share = row["of byte limit"]
        report.check(f"{row['op']} >= {TARGET:.0%} of its byte limit", share >= TARGET, of_limit=round(share, 3))


if __name__ == "__main__":
    main("kernels", run)
