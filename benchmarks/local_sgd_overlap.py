"""How long Local SGD and CO2 sync points block, side by side, on the demo task.

    PYTHONPATH=. python benchmarks/local_sgd_overlap.py --ranks 2 --steps 200

Trains DDP (reference), Local SGD (H = 4, blocking average) and CO2 (H = 4, background
average) in one run and prints, per method: bytes per step, wall time of the whole run,
the number of sync points, the median and largest time a sync point was blocked by
communication (Local SGD: the whole all-reduce; CO2: only what the next round's compute
did not hide), and the final held-out loss. Run it under a throttled link (docs/local_sgd.md)
to see the time saved.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from commpress.bench.launch import run_local
from commpress.terminal import format_table

ROWS = {
    "ddp": {"method": "none"},
    "local-sgd h=4": {"method": "none", "local_sgd": {"period": 4}},
    "co2 h=4": {"method": "none", "local_sgd": {"algorithm": "co2", "period": 4, "outer_lr": 0.7}},
}


def _rank(rank: int, world: int, steps: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from commpress.workloads.train import train_ddp

    out = []
    for label, config in ROWS.items():
        dist.barrier()
        t0 = time.perf_counter()
        result = train_ddp(config, steps=steps)
        waits = (result.state or {}).get("wait_seconds", []) if "local_sgd" in config else []
        out.append(
            {
                "label": label,
                "bytes": result.bytes_per_step,
                "seconds": time.perf_counter() - t0,
                "syncs": len(waits),
                "wait_median_ms": 1000 * statistics.median(waits) if waits else 0.0,
                "wait_max_ms": 1000 * max(waits) if waits else 0.0,
                "loss": result.eval_loss,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    results = run_local(_rank, args.ranks, args.steps)
    rows = []
    for i, r in enumerate(results[0]):
        slowest = max(rank[i]["seconds"] for rank in results)
        rows.append(
            [
                r["label"],
                f"{r['bytes']:,.0f}",
                f"{slowest:.2f}",
                r["syncs"],
                f"{r['wait_median_ms']:.2f}",
                f"{r['wait_max_ms']:.2f}",
                f"{r['loss']:.4f}",
            ]
        )
    headers = ["method", "bytes/step/rank", "run s", "syncs", "wait median ms", "wait max ms", "final loss"]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
