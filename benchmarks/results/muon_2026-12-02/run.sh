#!/usr/bin/env bash
# Muon in the race (2 ranks on loopback: steps and losses do not depend on the link), the
# race's transformer under its default warm-up + cosine schedule, seed SEED (default 0):
#   STEP=screen LR=2e-3 run.sh   DDP + Muon at Muon lr LR alone (AdamW at its 1e-3 on the rest):
#     screen_lr2e-3_seed0 .. screen_lr1.6e-2_seed0 (rows_lr1e-3_seed0 holds the 1e-3 point)
#   STEP=rows LR=1e-3 run.sh   DDP + Muon and slow-link under Muon: rows_lr1e-3_seed0 (and LR=8e-3 SEED=1)
#   STEP=slow LR=2e-3 TARGET=1.2153 run.sh   slow-link under Muon alone, to DDP + Muon's step-400
#     loss at that lr (screen_lr2e-3_seed0): slow_lr2e-3_seed0
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/muon_2026-12-02
C=docs/configs
S=${SEED:-0}
case "${STEP:-screen}" in
  screen) ARGS=(--methods ddp --target-steps 400 --max-steps 400); NAME=screen_lr${LR}_seed$S ;;
  rows) ARGS=(--methods ddp --config $C/slow-link.toml --target-steps 400 --max-steps 600); NAME=rows_lr${LR}_seed$S ;;
  slow) ARGS=(--config $C/slow-link.toml --target "$TARGET" --max-steps 600); NAME=slow_lr${LR}_seed$S ;;
esac
$PY -m commpress race --local 2 --optimizer muon --lr "$LR" "${ARGS[@]}" --eval-every 10 --seed "$S" --quiet \
  --json $R/$NAME.json > $R/$NAME.log 2>&1
