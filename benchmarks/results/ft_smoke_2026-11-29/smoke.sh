#!/usr/bin/env bash
# Every ready config through the torchft Manager with failures: commpress.bench.ft_race on
# linkemu, 3 replica groups at 100 Mbit/s, replica 2 killed about every 15 of its steps and
# restarted, 40 steps (the target 0.1 is never reached: every run goes to the end).
# Usage: smoke.sh OUT CONFIG...   (one row per config; OUT/progress: exit code, seconds,
# gloo timeouts in the replicas' logs)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
OUT=$1; shift
mkdir -p "$OUT"
for c in "$@"; do
  s=$(date +%s)
  timeout 400 .venv/bin/python -m commpress linkemu --ranks 3 --rate 100mbit --timeout 380 --logs "$OUT/$c" -- \
    .venv/bin/python -m commpress.bench.ft_race --mode commpress --config "docs/configs/$c.toml" --eval-every 10 \
    --target 0.1 --max-steps 40 --kill-every 15 --json "$OUT/$c.json" > "$OUT/$c.log" 2>&1
  rc=$?
  n=$(zcat -f "$OUT/$c"/* 2>/dev/null | grep -c "did not complete\|Timed out")
  echo "$c rc=$rc secs=$(( $(date +%s)-s )) timeouts=$n" >> "$OUT/progress"
done
