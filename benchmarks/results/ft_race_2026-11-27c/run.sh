#!/usr/bin/env bash
# Issue 42's race to the race's target (DDP-under-torchft's held-out loss after 400 steps, 1.197),
# 3 replica groups at 100 Mbit/s, replica 2 killed after about KILL of its steps at a random
# moment of a step (ft_race's KillSchedule, seeded: the same kills for every row of a seed).
# The rows without failures are ft_race_2026-11-27b's (unchanged code paths); sl0 again here.
set -u
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
D=benchmarks/results/ft_race_2026-11-27c
KILL=${KILL:-100}
TARGET=1.197
run() {  # name max-steps mode extra-args...
  local name=$1 max=$2; shift 2
  mkdir -p $D/$name
  timeout 1500 $PY -m commpress linkemu --ranks 3 --rate 100mbit --timeout 1480 --logs $D/$name -- \
    $PY -m commpress.bench.ft_race --eval-every 10 --json $D/$name.json --target $TARGET --max-steps $max "$@" > $D/$name.log 2>&1
  echo "$name exit $? $(date +%T)" >> $D/progress
}
run slK0 700 --mode commpress --config $D/sl3.toml --kill-every $KILL --kill-seed 0
run tfK0 700 --mode torchft-diloco --period 8 --kill-every $KILL --kill-seed 0
run slK1 700 --mode commpress --config $D/sl3.toml --kill-every $KILL --kill-seed 1
run tfK1 700 --mode torchft-diloco --period 8 --kill-every $KILL --kill-seed 1
run sl0 700 --mode commpress --config $D/sl3.toml
run ddpK0 600 --mode commpress --config docs/configs/none.toml --kill-every $KILL --kill-seed 0
echo done >> $D/progress
