#!/usr/bin/env bash
# 2026-11-29 (fifth session): docs/configs/slow-link-h1.toml on kill seed 0 with the wire's new
# entropy coder (commpress.kernels.huffman, 26734ad), torchft's DiLoCo and DDP through the
# manager in the same hour (h1K0e, tfK0e, ddpK0e, in that order); ft_race_2026-11-29's run6.sh
# is the same with deflate.
set -u
source "$(dirname "$0")/common.sh"
run h1K0e 700 --mode commpress --config docs/configs/slow-link-h1.toml --kill-every 100 --kill-seed 0
run tfK0e 700 --mode torchft-diloco --period 8 --kill-every 100 --kill-seed 0
run ddpK0e 700 --mode commpress --config docs/configs/none.toml --kill-every 100 --kill-seed 0
echo done >> $D/progress
