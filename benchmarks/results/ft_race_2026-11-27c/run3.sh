#!/usr/bin/env bash
# After run2.sh: the slow-link rows with and without failures back to back, twice more, so
# each run with failures has a run without failures minutes from it.
set -u
source "$(dirname "$0")/common.sh"
run slK3 700 --mode commpress --config $D/sl3.toml --kill-every 100 --kill-seed 3
run sl0c 700 --mode commpress --config $D/sl3.toml
run slK4 700 --mode commpress --config $D/sl3.toml --kill-every 100 --kill-seed 4
run sl0d 700 --mode commpress --config $D/sl3.toml
echo done3 >> $D/progress
