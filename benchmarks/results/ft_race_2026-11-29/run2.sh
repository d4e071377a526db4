#!/usr/bin/env bash
# After run.sh: DDP's all-reduce through the manager (docs/configs/none.toml), kill seed 0.
set -u
source "$(dirname "$0")/common.sh"
run ddpK0 700 --mode commpress --config docs/configs/none.toml --kill-every 100 --kill-seed 0
echo done2 >> $D/progress
