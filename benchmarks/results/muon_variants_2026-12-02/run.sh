#!/usr/bin/env bash
# Under Muon at its best rate of the screen (8e-3; benchmarks/results/muon_2026-12-02), seed 0,
# 2 ranks on loopback, the race's transformer under its warm-up + cosine schedule, each row to
# DDP + Muon's step-400 loss there (1.0419, screen_lr8e-3_seed0): the slow-link config's
# variants and Dion at several ranks.
#   NAME=quant2ef run.sh       a file of this folder (NAME.toml): NAME_seed0.json
#   NAME=dion16 CONFIG=docs/configs/dion.toml run.sh   a ready config (also slow-link-muon,
#     slow-link-h1: CONFIG=docs/configs/NAME.toml)
#   NAME=powersgd16 METHODS=powersgd:rank=16 run.sh    a method spec (PowerSGD under Muon)
#   LR=3.2e-2 NAME=dion16_lr3.2e-2 CONFIG=docs/configs/dion.toml run.sh   another Muon (Dion) lr
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=benchmarks/results/muon_variants_2026-12-02
if [ -n "${METHODS:-}" ]; then ROW=(--methods "$METHODS"); else ROW=(--config "${CONFIG:-$R/$NAME.toml}"); fi
.venv/bin/python -m commpress race --local 2 --optimizer muon --lr ${LR:-8e-3} "${ROW[@]}" --target 1.0419 --max-steps 600 \
  --eval-every 10 --seed "${SEED:-0}" --quiet --json $R/${NAME}_seed${SEED:-0}.json > $R/${NAME}_seed${SEED:-0}.log 2>&1
