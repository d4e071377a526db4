#!/usr/bin/env bash
# 2026-11-29 (second session): kill seed 2 for all three rows in one hour, the slow-link
# config again (slK2b), torchft's DiLoCo (tfK2) and DDP's all-reduce through the manager
# (ddpK2), so the seed-2 ratios pair rows minutes apart.
set -u
source "$(dirname "$0")/common.sh"
C=docs/configs/slow-link.toml
run slK2b 700 --mode commpress --config $C --kill-every 100 --kill-seed 2
run tfK2 700 --mode torchft-diloco --period 8 --kill-every 100 --kill-seed 2
run ddpK2 700 --mode commpress --config docs/configs/none.toml --kill-every 100 --kill-seed 2
echo done4 >> $D/progress
