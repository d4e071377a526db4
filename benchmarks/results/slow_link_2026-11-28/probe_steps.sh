#!/usr/bin/env bash
# Step time at 100 Mbit/s beside the computation alone, 120 steps each, run twice back to back:
# PyTorch's PowerSGD hook and slow-link.toml (no target to reach: --target 0.01).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/slow_link_2026-11-28
for run in 1 2; do
  $PY -m commpress linkemu --ranks 2 --rate 100mbit --timeout 900 -- \
    $PY -m commpress race --methods "torch-powersgd:rank=4" --config docs/configs/slow-link.toml \
    --target 0.01 --max-steps 120 --eval-every 1000 --json $R/probe_steps_$run.json 2>&1 | tee $R/probe_steps_$run.log
done
