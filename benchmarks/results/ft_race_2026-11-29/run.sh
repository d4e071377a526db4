#!/usr/bin/env bash
# The ready slow-link config (docs/configs/slow-link.toml: entropy-coded TernGrad, outer lr
# "sqrt_replicas", which under the manager follows each sync's participants) with a replica
# killed about every 100 of its steps and without failures, beside torchft's DiLoCo on the
# same kill seeds, alternating, so each row has its neighbours minutes away.
set -u
source "$(dirname "$0")/common.sh"
C=docs/configs/slow-link.toml
run slK0 700 --mode commpress --config $C --kill-every 100 --kill-seed 0
run sl0 700 --mode commpress --config $C
run tfK0 700 --mode torchft-diloco --period 8 --kill-every 100 --kill-seed 0
run slK1 700 --mode commpress --config $C --kill-every 100 --kill-seed 1
run sl0b 700 --mode commpress --config $C
run tfK1 700 --mode torchft-diloco --period 8 --kill-every 100 --kill-seed 1
echo done >> $D/progress
