"""DiLoCo's defaults against the paper's outer step and plain averaging of gradients.

``[local_sgd] algorithm = "diloco"`` with ``period = 8`` and nothing else (the table's
defaults), the same with the paper's outer step (lr 0.7, momentum 0.9, Nesterov), and
``none`` (DDP's exact average): the demo's character MLP on 2 ranks simulated in one
process (the quality suite's ``train``), 150 steps, SGD and AdamW, 3 seeds. Prints each
run's held-out loss and each DiLoCo row's ratio to ``none`` on the same seed.

    PYTHONPATH=. python benchmarks/diloco_defaults.py --json defaults.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from commpress.bench.quality import train

ROWS = {
    "none": {"method": "none"},
    "diloco H8 defaults": {"method": "none", "local_sgd": {"algorithm": "diloco", "period": 8}},
    "diloco H8 paper 0.7/0.9": {
        "method": "none",
        "local_sgd": {"algorithm": "diloco", "period": 8, "outer_lr": 0.7, "outer_momentum": 0.9},
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every run's held-out loss here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict[str, list[float]] = {}
    for opt in ("sgd", "adamw"):
        for label, cfg in ROWS.items():
            out[f"{opt} {label}"] = [train("charlm", opt, label, s, args.steps, cfg).eval_loss for s in range(args.seeds)]
            print(opt, label, [round(x, 4) for x in out[f"{opt} {label}"]], flush=True)
        for label in list(ROWS)[1:]:
            ratios = [a / b for a, b in zip(out[f"{opt} {label}"], out[f"{opt} none"])]
            print(f"  {opt} {label}: {statistics.mean(ratios):.3f}x none (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
