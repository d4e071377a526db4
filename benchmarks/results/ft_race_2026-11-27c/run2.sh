#!/usr/bin/env bash
# After run.sh (the machine's speed drifts by up to 30% over hours: the rows without failures
# again beside those with): tf0 and sl0b without failures, slK2 with kill seed 2.
set -u
source "$(dirname "$0")/common.sh"
run tf0 700 --mode torchft-diloco --period 8
run sl0b 700 --mode commpress --config $D/sl3.toml
run slK2 700 --mode commpress --config $D/sl3.toml --kill-every 100 --kill-seed 2
echo done2 >> $D/progress
