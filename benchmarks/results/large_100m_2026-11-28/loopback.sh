#!/usr/bin/env bash
# The larger transformer's steps on 2 loopback ranks (steps do not depend on the link), to
# DDP's 400-step loss of large_gbit_2026-11-28 (2.2154, same seed and data): the slow-link
# config with its pseudo-gradients in fp32, with outer lr 1.0 and without the delay, 250 steps
# each (diag.json); then outer lr 1.0 to the target (lr1.json). The slow-link config's own curve
# is large_gbit_2026-11-28's.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/large_100m_2026-11-28
LARGE="--width 768 --layers 4 --heads 12 --batch 4"
EACH="--local 2 --warmup 0 --compute-steps 1 --eval-every 10"
$PY -m commpress race $EACH --config $R/fp32.toml --config $R/lr1.toml --config $R/nodelay.toml \
  $LARGE --target 2.2154 --max-steps 250 --json $R/diag.json
$PY -m commpress race $EACH --config $R/lr1.toml $LARGE --target 2.2154 --max-steps 480 --json $R/lr1.json
# the default transformer (3.24M, batch 16), outer lr 1.0 against slow-link.toml's sqrt(2):
# target 1.2745, DDP's 400-step loss there (benchmarks/results/full_target_2026-11-27)
$PY -m commpress race $EACH --config $R/lr1.toml --target 1.2745 --max-steps 520 --json $R/default_lr1.json
# seed 1: DDP and outer lr 1.0, the target DDP's 400-step loss on that seed
$PY -m commpress race $EACH --methods ddp --config $R/lr1.toml $LARGE --seed 1 --target-steps 400 \
  --max-steps 440 --json $R/seed1.json
