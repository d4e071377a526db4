#!/usr/bin/env bash
# slow-link.toml (TernGrad entropy-coded) beside the same config without the coding, DDP and
# PyTorch's PowerSGD hook, at 100 Mbit/s between 2 ranks, to DDP's 400-step loss.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/slow_link_2026-11-28
$PY -m commpress linkemu --ranks 2 --rate 100mbit --timeout 2400 -- \
  $PY -m commpress race --methods "ddp;torch-powersgd:rank=4" --config docs/configs/slow-link.toml \
  --config $R/slow-link-2bit.toml --target-steps 400 --max-seconds 500 --eval-every 10 --json $R/race100.json \
  2>&1 | tee $R/race100.log
