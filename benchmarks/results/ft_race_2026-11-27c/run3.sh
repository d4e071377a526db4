#!/usr/bin/env bash
# Third part: the slow-link rows with and without failures back to back, twice more, so each
# run with failures has a run without failures minutes from it (the machine's speed drifts).
set -u
cd "$(dirname "$0")/../../.."
PY=.venv/bin/python
D=benchmarks/results/ft_race_2026-11-27c
run() {
  local name=$1 max=$2; shift 2
  mkdir -p $D/$name
  timeout 1500 $PY -m commpress linkemu --ranks 3 --rate 100mbit --timeout 1480 --logs $D/$name -- \
    $PY -m commpress.bench.ft_race --eval-every 10 --json $D/$name.json --target 1.197 --max-steps $max "$@" > $D/$name.log 2>&1
  echo "$name exit $? $(date +%T)" >> $D/progress
}
run slK3 700 --mode commpress --config $D/sl3.toml --kill-every 100 --kill-seed 3
run sl0c 700 --mode commpress --config $D/sl3.toml
run slK4 700 --mode commpress --config $D/sl3.toml --kill-every 100 --kill-seed 4
run sl0d 700 --mode commpress --config $D/sl3.toml
echo done3 >> $D/progress
