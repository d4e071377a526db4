#!/usr/bin/env bash
# Outer settings of the slow-link config on 2-rank loopback (steps do not depend on the link),
# seed 0, target 1.2745 (DDP's 400-step loss on seed 0, from race100.json beside this folder).
# base.toml is docs/configs/slow-link.toml; the others change outer_lr, outer_momentum, nesterov.
cd "$(dirname "$0")"
python -m commpress race --local 2 --target 1.2745 --max-steps 480 --warmup 0 --compute-steps 1 \
  --config base.toml --config nest05.toml --config nest03.toml --config lr17.toml --config nest09.toml \
  --json sweep1.json --quiet > sweep1.log 2>&1
