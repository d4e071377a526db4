#!/usr/bin/env bash
# Every ready config under the race's default schedule (AdamW lr 1e-3, 20 warm-up steps,
# cosine to 1e-4 at step 400), 2 ranks on loopback (steps and losses do not depend on the
# link): each row's held-out loss at step 400 beside DDP's, and bytes per step.
#   ROWS=slow SEED=0 VARIANT=slow-link-lr1 run.sh   ddp, the slow-link configs and an outer-lr variant
#   ROWS=slow SEED=1 VARIANT=slow-link-lr2 run.sh   (seed 1: the other variant)
#   ROWS=all  SEED=0 run.sh   ddp, PyTorch's PowerSGD hook, the other ready DDP configs and slow-link-lr2
#   ROWS=lr2  SEED=0 RANKS=2 run.sh   ddp, slow-link and slow-link-lr2 alone (the outer lr's second seed, more ranks)
#   ROWS=lr4  SEED=0 RANKS=4 run.sh   ddp, slow-link (sqrt(4) = 2.0) and slow-link-lr2.8 (outer lr 2.83) on 4 ranks
#   ROWS=lr3  SEED=0 RANKS=3 run.sh   slow-link-lr2.45 alone on 3 ranks to that run's ddp loss (sqrt(2M) = sqrt(6); lr2_seed0_ranks3 has ddp, 1.73, 2.0)
#   ROWS=each SEED=0 TARGET=1.4757 run.sh   each of ROWS=all's rows in its own run, to DDP's step-400 loss of an
#     earlier run of that seed (each row's result is kept as it ends; loss at 400 is compared with that DDP run's)
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
R=benchmarks/results/schedule_race_2026-12-01
C=docs/configs
if [ "${ROWS:-slow}" = each ]; then
  for row in "torch-powersgd:rank=4" powersgd topk quant onebit_adam diloco bf16 terngrad streaming-diloco; do
    case $row in torch-*) ROW=(--methods "$row"); NAME=torch-powersgd ;; *) ROW=(--config $C/$row.toml); NAME=$row ;; esac
    $PY -m commpress race --local "${RANKS:-2}" "${ROW[@]}" --target "$TARGET" --max-steps 600 --eval-every 10 \
      --seed "${SEED:-0}" --quiet --json $R/each_${NAME}_seed${SEED:-0}.json 2>&1 | tee $R/each_${NAME}_seed${SEED:-0}.log
  done
  exit 0
fi
if [ "${ROWS:-slow}" = lr3 ]; then  # to lr2_seed0_ranks3.json's ddp loss at 400 (the schedule still ends at 400)
  $PY -m commpress race --local 3 --config $R/slow-link-lr2.45.toml --target 1.3907 --max-steps 600 --eval-every 10 \
    --seed "${SEED:-0}" --quiet --json $R/lr3_seed${SEED:-0}_ranks3.json 2>&1 | tee $R/lr3_seed${SEED:-0}_ranks3.log
  exit 0
fi
if [ "${ROWS:-slow}" = lr4 ]; then
  ARGS=(--methods ddp --config $C/slow-link.toml --config $R/slow-link-lr2.8.toml)
elif [ "${ROWS:-slow}" = lr2 ]; then
  ARGS=(--methods ddp --config $C/slow-link.toml --config $R/slow-link-lr2.toml)
elif [ "${ROWS:-slow}" = slow ]; then
  ARGS=(--methods ddp --config $C/slow-link-h1.toml --config $C/slow-link.toml --config $R/${VARIANT:-slow-link-lr1}.toml)
else
  ARGS=(--methods "ddp;torch-powersgd:rank=4")
  for f in bf16 powersgd terngrad quant topk onebit_adam diloco streaming-diloco; do
    ARGS+=(--config $C/$f.toml)
  done
  ARGS+=(--config $R/slow-link-lr2.toml)
fi
NAME=${ROWS:-slow}_seed${SEED:-0}
[ "${RANKS:-2}" = 2 ] || NAME=${NAME}_ranks${RANKS}
$PY -m commpress race --local "${RANKS:-2}" "${ARGS[@]}" --target-steps 400 --max-steps 600 --eval-every 10 \
  --seed "${SEED:-0}" --quiet --json $R/$NAME.json 2>&1 | tee $R/$NAME.log
