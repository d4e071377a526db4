"""Isolate why a method misses the quality suite's target: the same runs as
``commpress quality`` (2 simulated ranks, 200 steps, seeds 0..2) with one setting changed.

    python benchmarks/quality_causes.py terngrad   # which tensors cost TernGrad on `shapes`
    python benchmarks/quality_causes.py co2        # CO2's one-round-late average on `charlm`
    python benchmarks/quality_causes.py local-sgd  # Local SGD's period on `shapes`
    python benchmarks/quality_causes.py topk-adamw # Top-k's ratio under AdamW on `shapes`
    python benchmarks/quality_causes.py topk-dgc   # Top-k with DGC's ratio under SGD on `shapes`
    python benchmarks/quality_causes.py qsdp       # QSDP's weights vs gradients on `shapes`

Prints the mean gap of the held-out loss vs ``none`` (and its range over seeds) per
variant; docs/choosing.md quotes the output.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import torch

from commpress.bench import quality

VARIANTS: dict[str, tuple[str, tuple[str, ...], dict[str, dict[str, Any]]]] = {
    "terngrad": (
        "shapes",
        ("sgd", "adamw"),
        {
            "terngrad": {"method": "terngrad"},
            "terngrad, no clipping": {"method": "terngrad", "params": {"clip_sigma": 0.0}},
            "terngrad, convs exact": {"method": "terngrad", "overrides": [{"params": ["features.*"], "method": "none"}]},
            "terngrad, head.0 exact": {"method": "terngrad", "overrides": [{"params": ["head.0.*"], "method": "none"}]},
            "terngrad, biases exact": {"method": "terngrad", "overrides": [{"params": ["*.bias"], "method": "none"}]},
        },
    ),
    "local-sgd": (
        "shapes",
        ("adamw", "sgd"),
        {
            "local sgd, period 1": {"method": "none", "local_sgd": {"period": 1}},
            "local sgd, period 2": {"method": "none", "local_sgd": {"period": 2}},
            "local sgd, period 4": {"method": "none", "local_sgd": {"period": 4}},
        },
    ),
    "topk-adamw": (
        "shapes",
        ("adamw",),
        {f"topk, ratio {r}": {"method": "topk", "params": {"ratio": r}} for r in (0.01, 0.03, 0.1, 0.3, 1.0)},
    ),
    "topk-dgc": (
        "shapes",
        ("sgd",),
        {f"topk dgc, ratio {r}": {"method": "topk", "params": {"ratio": r, "dgc": True}} for r in (0.01, 0.03, 0.1, 0.3)},
    ),
    "qsdp": (
        "shapes",
        ("sgd",),
        {
            f"qsdp w{w}g{g}": {"method": "none", "fsdp": {"weight_bits": w, "grad_bits": g}}
            for w, g in ((8, 8), (8, 32), (32, 8))
        },
    ),
    "co2": (
        "charlm",
        ("sgd",),
        {
            "local sgd, period 5": {"method": "none", "local_sgd": {"period": 5}},
            "co2, period 5, outer_lr 1.0": {"method": "none", "local_sgd": {"algorithm": "co2", "period": 5, "outer_lr": 1.0}},
            "co2, period 5, outer_lr 0.7": {"method": "none", "local_sgd": {"algorithm": "co2", "period": 5, "outer_lr": 0.7}},
            "co2, period 5, outer_lr 0.5": {"method": "none", "local_sgd": {"algorithm": "co2", "period": 5, "outer_lr": 0.5}},
            "co2, period 10, outer_lr 0.7": {"method": "none", "local_sgd": {"algorithm": "co2", "period": 10, "outer_lr": 0.7}},
            "co2, period 2, outer_lr 1.0": {"method": "none", "local_sgd": {"algorithm": "co2", "period": 2, "outer_lr": 1.0}},
        },
    ),
}


def main(which: str, seeds: int = 3, steps: int = 200) -> None:
    task, optimizers, variants = VARIANTS[which]
    for opt in optimizers:
        base = [quality.train(task, opt, "none", s, steps).eval_loss for s in range(seeds)]
        for name, config in variants.items():
            try:
                runs = [quality.train(task, opt, name, s, steps, config=config) for s in range(seeds)]
            except FloatingPointError as exc:
                print(f"{task} {opt:5s} {name:30s} diverged: {exc}", flush=True)
                continue
            gaps = [100 * (r.eval_loss - b) / b for r, b in zip(runs, base)]
            per_seed = " ".join(f"{g:+.1f}" for g in gaps)
            print(
                f"{task} {opt:5s} {name:30s} bytes/step {runs[0].bytes_per_step:9,.0f}  gap {statistics.fmean(gaps):+.2f}% "
                f"(seeds: {per_seed})",
                flush=True,
            )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1] if len(sys.argv) > 1 else "terngrad")
