D=benchmarks/results/h1_outer_lr_2026-11-29  # run from the repository root
.venv/bin/python -m commpress race --local 2 --methods ddp --config docs/configs/slow-link-h1.toml --config $D/h1_lr1.7.toml --target-steps 400 --max-steps 460 --eval-every 10 --seed 2 --json $D/lr_seed2.json > $D/lr_seed2.log 2>&1
