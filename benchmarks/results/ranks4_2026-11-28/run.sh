#!/usr/bin/env bash
# The full-run race at 100 Mbit/s between 4 ranks: DDP, PyTorch's PowerSGD hook and the
# slow-link config with its outer lr at sqrt(4) = 2.0, to DDP's 400-step loss.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/ranks4_2026-11-28
$PY -m commpress linkemu --ranks 4 --rate 100mbit --timeout 3600 -- \
  $PY -m commpress race --methods "ddp;torch-powersgd:rank=4" --config $R/slow-link-4.toml \
  --target-steps 400 --max-seconds 1000 --eval-every 10 --json $R/race4.json \
  2>&1 | tee $R/race4.log
