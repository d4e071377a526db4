#!/usr/bin/env bash
# The fault-tolerance race of issue 42: 3 replica groups at 100 Mbit/s (linkemu), replica 2
# killed every KILL victim steps; target = DDP-under-torchft's held-out loss after 100 steps.
set -u
cd /work/main
PY=.venv/bin/python
KILL=${KILL:-25}
run() {  # name mode extra-args...
  local name=$1; shift
  mkdir -p /work/ftm/$name
  timeout 1000 $PY -m commpress linkemu --ranks 3 --rate 100mbit --timeout 980 --logs /work/ftm/$name -- \
    $PY -m commpress.bench.ft_race --eval-every 10 --json /work/ftm/$name.json "$@" > /work/ftm/$name/rank0.log 2>&1
  echo "$name exit $? $(date +%T)" >> /work/ftm/progress
}
run ddp0 --mode commpress --config docs/configs/none.toml --target 0 --max-steps 100
TARGET=$($PY -c "import json; print(round(json.load(open('/work/ftm/ddp0.json'))['curve'][-1][2], 4))")
echo "target $TARGET" >> /work/ftm/progress
run sdl0 --mode commpress --config docs/configs/streaming-diloco.toml --target $TARGET --max-steps 400
run sdlK --mode commpress --config docs/configs/streaming-diloco.toml --target $TARGET --max-steps 400 --kill-every $KILL
run tfdK --mode torchft-diloco --period 8 --target $TARGET --max-steps 400 --kill-every $KILL
run tfd0 --mode torchft-diloco --period 8 --target $TARGET --max-steps 400
run ddpK --mode commpress --config docs/configs/none.toml --target $TARGET --max-steps 400 --kill-every $KILL
echo done >> /work/ftm/progress
