#!/usr/bin/env bash
# The slow-link config's outer lr on 4 ranks (loopback; steps do not depend on the link):
# steps to the 4-rank 100 Mbit/s race's target (1.1763, DDP's 400-step loss there).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/ranks4_2026-11-28
$PY -m commpress race --local 4 --target 1.1763 --max-steps 560 --warmup 0 --compute-steps 1 --eval-every 10 \
  --config $R/sl4_lr1.41.toml --config $R/sl4_lr1.73.toml --json $R/lr_sweep.json --quiet 2>&1 | tee $R/lr_sweep.log
