#!/usr/bin/env bash
# The sharded slow-link row (outer lr 1.0) end to end at 100 Mbit/s between the groups, to plain
# HSDP's 300-step loss from loopback.sh (2.0396). HSDP itself would take over an hour here
# (300 x 13.5 s); its time is its steps x its probed step time (probe100.sh).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/sharded_large_2026-11-28
$PY -m commpress linkemu --ranks 4 --nodes 2 --inter-rate 100mbit --timeout 3000 -- \
  $PY -m commpress race --shards 2 --config $R/lr1.toml \
  --width 768 --layers 4 --heads 12 --batch 4 \
  --target 2.0396 --max-steps 300 --eval-every 10 --json $R/race100.json \
  2>&1 | tee $R/race100.log
