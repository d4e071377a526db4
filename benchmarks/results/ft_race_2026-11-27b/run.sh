#!/usr/bin/env bash
# Issue 42's race to the race's target (DDP-under-torchft's held-out loss after 400 steps),
# 3 replica groups at 100 Mbit/s, replica 2 killed every KILL of its steps.
set -u
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
D=benchmarks/results/ft_race_2026-11-27b
KILL=${KILL:-100}
# The target, 1.197: DDP under torchft (none.toml through the manager) after 400 steps, on
# unthrottled links (the loss does not depend on the link):
#   commpress linkemu --ranks 3 --rate none -- python -m commpress.bench.ft_race --mode commpress \
#       --config docs/configs/none.toml --target 0 --max-steps 400 --json $D/ddpT.json
TARGET=${1:-1.197}
run() {  # name max-steps mode extra-args...
  local name=$1 max=$2; shift 2
  mkdir -p $D/$name
  timeout 1500 $PY -m commpress linkemu --ranks 3 --rate 100mbit --timeout 1480 --logs $D/$name -- \
    $PY -m commpress.bench.ft_race --eval-every 10 --json $D/$name.json --target $TARGET --max-steps $max "$@" > $D/$name.log 2>&1
  echo "$name exit $? $(date +%T)" >> $D/progress
}
run sl0 700 --mode commpress --config $D/sl3.toml
run slK 700 --mode commpress --config $D/sl3.toml --kill-every $KILL
run tf0 700 --mode torchft-diloco --period 8
run tfK 700 --mode torchft-diloco --period 8 --kill-every $KILL
run ddpK 600 --mode commpress --config docs/configs/none.toml --kill-every $KILL
run ddp0 600 --mode commpress --config docs/configs/none.toml
# a second run of three rows, the same evening (sl0b, slKb, tfKb)
run sl0b 700 --mode commpress --config $D/sl3.toml
run slKb 700 --mode commpress --config $D/sl3.toml --kill-every $KILL
run tfKb 700 --mode torchft-diloco --period 8 --kill-every $KILL
echo done >> $D/progress
