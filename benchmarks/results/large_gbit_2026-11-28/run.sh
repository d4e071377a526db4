#!/usr/bin/env bash
# The full-run race on the larger transformer (28.6M parameters, 109 MiB of gradient a step)
# at 1 Gbit/s between 2 ranks: DDP, PyTorch's PowerSGD hook and the slow-link config, to
# DDP's 400-step loss.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/large_gbit_2026-11-28
$PY -m commpress linkemu --ranks 2 --rate 1gbit --timeout 3600 -- \
  $PY -m commpress race --methods "ddp;torch-powersgd:rank=4" --config docs/configs/slow-link.toml \
  --width 768 --layers 4 --heads 12 --batch 4 \
  --target-steps 400 --max-seconds 900 --eval-every 10 --json $R/race_large1g.json \
  2>&1 | tee $R/race_large1g.log
