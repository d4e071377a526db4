#!/usr/bin/env bash
# commpress's PowerSGD against PyTorch's hook, step time at 100 Mbit/s (linkemu, 2 ranks,
# 120 steps each): DDP's default buckets and one bucket (--bucket-cap-mb 14), each order of
# the two rows. The results here: r1, r2 with PyTorch's row first (named r1_default, r1_14, ...),
# r3, r4 with each order (r3_ours_default: commpress's row first).
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
D=benchmarks/results/powersgd_step_2026-11-27
for rep in 1 2 3; do
  for order in ours torch; do
    for cap in default 14; do
      extra=""; [ $cap != default ] && extra="--bucket-cap-mb $cap"
      m="torch-powersgd:rank=4;powersgd:rank=4"; [ $order = ours ] && m="powersgd:rank=4;torch-powersgd:rank=4"
      timeout 900 $PY -m commpress linkemu --ranks 2 --rate 100mbit --timeout 880 -- $PY -m commpress race \
        --methods "$m" --target 0.01 --max-steps 120 --eval-every 1000 \
        --compute-steps 40 --quiet --json $D/r${rep}_${order}_$cap.json $extra > $D/r${rep}_${order}_$cap.log 2>&1
      echo "r${rep}_${order}_$cap exit $? $(date +%T)" >> $D/progress
    done
  done
done
