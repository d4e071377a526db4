#!/usr/bin/env bash
# The full-run race at 1 Gbit/s between 2 ranks: DDP, PyTorch's PowerSGD hook, the slow-link
# config and the 4-bit quant config (AdamW's best per-step compressor), to DDP's 400-step loss.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/gbit_2026-11-28
$PY -m commpress linkemu --ranks 2 --rate 1gbit --timeout 2400 -- \
  $PY -m commpress race --methods "ddp;torch-powersgd:rank=4" --config docs/configs/slow-link.toml \
  --config docs/configs/quant.toml --target-steps 400 --max-seconds 500 --eval-every 10 --json $R/race1g.json \
  2>&1 | tee $R/race1g.log
