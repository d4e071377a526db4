#!/usr/bin/env bash
# slow-link-h1.toml and slow-link.toml beside DDP and PyTorch's PowerSGD hook at 100 Mbit/s
# between 2 ranks, to DDP's 400-step loss (the race of docs/benchmarks.md's slow-link section).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/h1_race_2026-11-29
$PY -m commpress linkemu --ranks 2 --rate 100mbit --timeout 2600 -- \
  $PY -m commpress race --methods "ddp;torch-powersgd:rank=4" --config docs/configs/slow-link-h1.toml \
  --config docs/configs/slow-link.toml --target-steps 400 --max-seconds 500 --eval-every 10 --seed "${SEED:-0}" --json $R/race100${SEED:+_seed$SEED}.json \
  2>&1 | tee $R/race100${SEED:+_seed$SEED}.log
