#!/usr/bin/env bash
# The larger transformer (28.6M parameters) sharded as 2 groups x 2 shards on 4 loopback ranks
# (steps do not depend on the link): plain HSDP to its own 300-step loss, and the slow-link config
# with outer lr 1.0 (lr1.toml; the larger model's measured best) to that loss.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/sharded_large_2026-11-28
$PY -m commpress race --local 4 --shards 2 --warmup 0 --compute-steps 1 --eval-every 10 \
  --width 768 --layers 4 --heads 12 --batch 4 \
  --methods ddp --config $R/lr1.toml --target-steps 300 --max-steps 360 --json $R/loopback.json
