#!/usr/bin/env bash
# Step times of the larger transformer sharded as 2 groups x 2 shards, fast links inside a group
# and 100 Mbit/s between the groups: plain HSDP and the slow-link config with outer lr 1.0,
# 30 steps each beside the computation alone (the steps to HSDP's loss come from loopback.sh).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/sharded_large_2026-11-28
$PY -m commpress linkemu --ranks 4 --nodes 2 --inter-rate 100mbit --timeout 2400 -- \
  $PY -m commpress race --shards 2 --methods ddp --config $R/lr1.toml \
  --width 768 --layers 4 --heads 12 --batch 4 \
  --target 0.01 --max-steps 30 --eval-every 1000 --json $R/probe100.json \
  2>&1 | tee $R/probe100.log
