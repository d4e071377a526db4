#!/usr/bin/env bash
# Second part, right after run.sh (the machine's speed drifts by up to 20% over hours: the
# no-failure rows again beside the failure rows): tf0 and sl0b without failures, slK2 with seed 2.
set -u
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
D=benchmarks/results/ft_race_2026-11-27c
while ! grep -q done $D/progress; do sleep 5; done
run() {
  local name=$1 max=$2; shift 2
  mkdir -p $D/$name
  timeout 1500 $PY -m commpress linkemu --ranks 3 --rate 100mbit --timeout 1480 --logs $D/$name -- \
    $PY -m commpress.bench.ft_race --eval-every 10 --json $D/$name.json --target 1.197 --max-steps $max "$@" > $D/$name.log 2>&1
  echo "$name exit $? $(date +%T)" >> $D/progress
}
run tf0 700 --mode torchft-diloco --period 8
run sl0b 700 --mode commpress --config $D/sl3.toml
run slK2 700 --mode commpress --config $D/sl3.toml --kill-every 100 --kill-seed 2
echo done2 >> $D/progress
