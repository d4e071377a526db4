#!/usr/bin/env bash
# After run2.sh: one more slow-link pair, with failures (kill seed 2) and without.
set -u
source "$(dirname "$0")/common.sh"
C=docs/configs/slow-link.toml
run slK2 700 --mode commpress --config $C --kill-every 100 --kill-seed 2
run sl0c 700 --mode commpress --config $C
echo done3 >> $D/progress
