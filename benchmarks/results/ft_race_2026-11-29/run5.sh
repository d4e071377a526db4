#!/usr/bin/env bash
# 2026-11-29 (third session): kill seed 0 for all three rows in one hour, as run4.sh did for
# seed 2 (slK0c, tfK0c, ddpK0c), then CO2 under the manager (co2K0: docs/configs/co2_h4.toml,
# the plain average a round late, through the same kills).
set -u
source "$(dirname "$0")/common.sh"
C=docs/configs/slow-link.toml
run slK0c 700 --mode commpress --config $C --kill-every 100 --kill-seed 0
run tfK0c 700 --mode torchft-diloco --period 8 --kill-every 100 --kill-seed 0
run ddpK0c 700 --mode commpress --config docs/configs/none.toml --kill-every 100 --kill-seed 0
echo done5 >> $D/progress
run co2K0 900 --mode commpress --config docs/configs/co2_h4.toml --kill-every 100 --kill-seed 0
echo done5co2 >> $D/progress
