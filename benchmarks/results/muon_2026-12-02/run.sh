#!/usr/bin/env bash
# Muon in the race (2 ranks on loopback: steps and losses do not depend on the link), the
# race's transformer under its default warm-up + cosine schedule, seed 0:
#   STEP=screen run.sh   DDP + Muon at Muon lr 1e-3 and 2e-3 (AdamW at its 1e-3 on the rest)
#   STEP=rows LR=<best> run.sh   DDP + Muon, slow-link-h1 and slow-link under Muon
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/muon_2026-12-02
C=docs/configs
if [ "${STEP:-screen}" = screen ]; then
  for lr in 1e-3 2e-3; do
    $PY -m commpress race --local 2 --optimizer muon --lr $lr --methods ddp --target-steps 400 --max-steps 400 \
      --eval-every 10 --seed "${SEED:-0}" --quiet --json $R/screen_lr${lr}_seed${SEED:-0}.json 2>&1 | tee $R/screen_lr${lr}_seed${SEED:-0}.log
  done
  exit 0
fi
$PY -m commpress race --local 2 --optimizer muon --lr "$LR" --methods ddp --config $C/slow-link-h1.toml --config $C/slow-link.toml \
  --target-steps 400 --max-steps 600 --eval-every 10 --seed "${SEED:-0}" --quiet --json $R/rows_seed${SEED:-0}.json 2>&1 | tee $R/rows_seed${SEED:-0}.log
