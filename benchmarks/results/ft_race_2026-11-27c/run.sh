#!/usr/bin/env bash
# Issue 42's race to the race's target (DDP-under-torchft's held-out loss after 400 steps, 1.197),
# 3 replica groups at 100 Mbit/s, replica 2 killed after about 100 of its steps at a random
# moment of a step (ft_race's KillSchedule, seeded: the same kills for every row of a seed).
# DDP without failures is ft_race_2026-11-27b's ddp0. Then run2.sh, then run3.sh.
set -u
source "$(dirname "$0")/common.sh"
run slK0 700 --mode commpress --config $D/sl3.toml --kill-every 100 --kill-seed 0
run tfK0 700 --mode torchft-diloco --period 8 --kill-every 100 --kill-seed 0
run slK1 700 --mode commpress --config $D/sl3.toml --kill-every 100 --kill-seed 1
run tfK1 700 --mode torchft-diloco --period 8 --kill-every 100 --kill-seed 1
run sl0 700 --mode commpress --config $D/sl3.toml
run ddpK0 600 --mode commpress --config docs/configs/none.toml --kill-every 100 --kill-seed 0
echo done >> $D/progress
