# Sourced by run.sh: one ft_race row on linkemu (3 ranks, 100 Mbit/s), as ft_race_2026-11-27c.
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
PY=.venv/bin/python
D=benchmarks/results/ft_race_2026-11-29
run() {  # name max-steps mode-and-kill-args...
  local name=$1 max=$2; shift 2
  mkdir -p $D/$name
  timeout 1500 $PY -m commpress linkemu --ranks 3 --rate 100mbit --timeout 1480 --logs $D/$name -- \
    $PY -m commpress.bench.ft_race --eval-every 10 --json $D/$name.json --target 1.197 --max-steps $max "$@" \
    > $D/$name.log 2>&1
  echo "$name exit $? $(date +%T)" >> $D/progress
}
