#!/usr/bin/env bash
# 2026-11-29 (fourth session): docs/configs/slow-link-h1.toml (DiLoCo every step, each average
# landing a step later) on kill seed 0, with the slow-link config, torchft's DiLoCo and DDP
# through the manager in the same hour (h1K0, slK0d, tfK0d, ddpK0d, in that order).
set -u
source "$(dirname "$0")/common.sh"
run h1K0 700 --mode commpress --config docs/configs/slow-link-h1.toml --kill-every 100 --kill-seed 0
run slK0d 700 --mode commpress --config docs/configs/slow-link.toml --kill-every 100 --kill-seed 0
run tfK0d 700 --mode torchft-diloco --period 8 --kill-every 100 --kill-seed 0
run ddpK0d 700 --mode commpress --config docs/configs/none.toml --kill-every 100 --kill-seed 0
echo done6 >> $D/progress
