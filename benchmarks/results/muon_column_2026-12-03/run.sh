#!/usr/bin/env bash
# The Muon column of docs/choosing.md: each ready config of docs/configs under Muon (8e-3, the
# best rate of benchmarks/results/muon_2026-12-02's screen) with AdamW on the rest, 2 ranks on
# loopback (steps and losses do not depend on the link), the race's transformer under its
# warm-up + cosine schedule, each row to DDP + Muon's step-400 loss on its seed (seed 0: 1.0419,
# screen_lr8e-3_seed0; seed 1: 1.0633, rows_lr8e-3_seed1), at most 1.5x its steps:
#   SEED=1 run.sh powersgd acpsgd ...   NAME_seedS.json / .log here for each docs/configs/NAME.toml
# A name whose JSON is here already is skipped, so an interrupted queue resumes.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=benchmarks/results/muon_column_2026-12-03
S=${SEED:-0}
case "$S" in 0) T=1.0419 ;; 1) T=1.0633 ;; *) echo "no DDP + Muon target for seed $S" >&2; exit 2 ;; esac
for NAME in "$@"; do
  [ -e "$R/${NAME}_seed$S.json" ] && continue
  .venv/bin/python -m commpress race --local 2 --optimizer muon --lr 8e-3 --config "docs/configs/$NAME.toml" \
    --target "$T" --max-steps 600 --eval-every 10 --seed "$S" --quiet --json "$R/${NAME}_seed$S.json" \
    > "$R/${NAME}_seed$S.log" 2>&1 || echo "$NAME seed $S: exit $?" >> "$R/failed.txt"
done
