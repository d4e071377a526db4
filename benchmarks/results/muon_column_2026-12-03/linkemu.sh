#!/usr/bin/env bash
# Muon's step times at 100 Mbit/s between 2 ranks (linkemu, nothing else running): DDP + Muon,
# PyTorch's PowerSGD hook + Muon, slow-link-muon.toml and the computation alone (the
# ceiling), 40 steps each (a step's time does not depend on the run's length); each row's
# time to DDP + Muon's step-400 loss is its steps to it on loopback (run.sh, table.py) x its
# ms/step here: linkemu100.json / .log.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=benchmarks/results/muon_column_2026-12-03
.venv/bin/python -m commpress linkemu --ranks 2 --rate 100mbit --timeout 1200 -- \
  .venv/bin/python -m commpress race --optimizer muon --lr 8e-3 --methods "ddp;torch-powersgd:rank=4" \
  --config docs/configs/slow-link-muon.toml --target-steps 40 --max-steps 40 --eval-every 10 --seed 0 \
  --json $R/linkemu100.json 2>&1 | tee $R/linkemu100.log
