#!/usr/bin/env bash
# Step times of the larger transformer at 100 Mbit/s between 2 ranks: DDP, PyTorch's PowerSGD
# hook and the slow-link config, 30 steps each (the steps to DDP's loss come from loopback).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/large_100m_2026-11-28
$PY -m commpress linkemu --ranks 2 --rate 100mbit --timeout 2400 -- \
  $PY -m commpress race --methods "ddp;torch-powersgd:rank=4" --config docs/configs/slow-link.toml \
  --width 768 --layers 4 --heads 12 --batch 4 \
  --target 0.01 --max-steps 30 --eval-every 1000 --json $R/probe100.json \
  2>&1 | tee $R/probe100.log
