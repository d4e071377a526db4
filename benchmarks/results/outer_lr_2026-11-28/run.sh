#!/usr/bin/env bash
# What sets DiLoCo's best outer lr? 2 loopback ranks (steps do not depend on the link).
# 1. The replicas' disagreement: in a throw-away clone with ratio.patch applied, rank 0 logs at
#    every sync sqrt(mean_i |d_i|^2) / |mean_i d_i| over the ranks' pseudo-gradients d_i,
#    exactly and through a 256-bucket count sketch (ratio_default.log: the default transformer
#    under slow-link.toml, its best outer lr sqrt(2); ratio_large.log: the larger one under
#    outer lr 1.0, its best, large_100m_2026-11-28).
# 2. slow-link.toml with outer_lr = 1.2 (lr12.toml) on both models, two seeds on the default.
# 3. Where the inner lr sits: DDP at AdamW lr 1.41e-3 on the default model, 7e-4 on the larger
#    (the task's lr is 1e-3 on both); then, at 7e-4 on the larger model, DDP to 200 steps and
#    outer lr 1.0 and 1.2 (tuned_*.json; crossings of DDP's 200-step loss: python crossings.py
#    tuned_ddp.json tuned_lr1.json tuned_lr12.json).
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=$PWD/benchmarks/results/outer_lr_2026-11-28
L=$PWD/benchmarks/results/large_100m_2026-11-28/lr1.toml
LARGE="--width 768 --layers 4 --heads 12 --batch 4"
CLONE=$(mktemp -d)
git clone -q . "$CLONE" && ln -s "$PWD/.venv" "$CLONE/.venv" && git -C "$CLONE" apply "$R/ratio.patch"
EACH="--local 2 --warmup 0 --compute-steps 1 --eval-every 20"
(cd "$CLONE" && RATIO_LOG=$R/ratio_default.log .venv/bin/python -m commpress race $EACH \
  --config docs/configs/slow-link.toml --target 1.2745 --max-steps 380)
(cd "$CLONE" && RATIO_LOG=$R/ratio_large.log .venv/bin/python -m commpress race $EACH \
  --config "$L" $LARGE --target 2.2154 --max-steps 100)
rm -rf "$CLONE"
PY=.venv/bin/python
EACH="--local 2 --warmup 0 --compute-steps 1 --eval-every 10"
$PY -m commpress race $EACH --config $R/lr12.toml --target 1.2745 --max-steps 500 --json $R/default.json
$PY -m commpress race $EACH --config $R/lr12.toml --config docs/configs/slow-link.toml --seed 1 --target 1.3030 \
  --max-steps 500 --json $R/default_seed1.json
$PY -m commpress race $EACH --config $R/lr12.toml $LARGE --target 2.2154 --max-steps 360 --json $R/large.json
$PY -m commpress race $EACH --methods ddp --lr 1.41e-3 --target 1.2745 --max-steps 440 --json $R/ddp_default_lr141.json
$PY -m commpress race $EACH --methods ddp --lr 7e-4 $LARGE --target 2.2154 --max-steps 250 --json $R/ddp_large_lr07.json
TUNED="$EACH $LARGE --lr 7e-4"
$PY -m commpress race $TUNED --methods ddp --target-steps 200 --max-steps 220 --json $R/tuned_ddp.json
$PY -m commpress race $TUNED --config "$L" --target 1.0 --max-steps 260 --json $R/tuned_lr1.json
$PY -m commpress race $TUNED --config $R/lr12.toml --target 1.0 --max-steps 260 --json $R/tuned_lr12.json
# 4. The default transformer at the larger one's batch (4 windows per replica): DDP to 400
#    steps, slow-link.toml (sqrt(2)) and outer lr 1.0 (python crossings.py batch4_ddp.json
#    batch4_slow_link.json batch4_lr1.json); then seed 1 (batch4_seed1_*.json).
for seed in 0 1; do
  B4="$EACH --batch 4 --seed $seed"
  S=$([ $seed = 0 ] && echo "" || echo "_seed1")
  $PY -m commpress race $B4 --methods ddp --target-steps 400 --max-steps 420 --json $R/batch4${S}_ddp.json
  $PY -m commpress race $B4 --config docs/configs/slow-link.toml --target 0.5 --max-steps 500 --json $R/batch4${S}_slow_link.json
  $PY -m commpress race $B4 --config "$L" --target 0.5 --max-steps 500 --json $R/batch4${S}_lr1.json
done
# 5. The larger model at 16 windows per replica, 120 steps: slow-link.toml (sqrt(2)) and outer lr 1.0.
E16="--local 2 --warmup 0 --compute-steps 1 --eval-every 20 $LARGE --batch 16"
$PY -m commpress race $E16 --config docs/configs/slow-link.toml --target 0.5 --max-steps 120 --json $R/large_batch16_slow_link.json
$PY -m commpress race $E16 --config "$L" --target 0.5 --max-steps 120 --json $R/large_batch16_lr1.json
