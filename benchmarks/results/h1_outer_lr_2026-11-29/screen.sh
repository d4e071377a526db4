D=benchmarks/results/h1_outer_lr_2026-11-29  # run from the repository root
for seed in 0 1; do
  t=1.2745; [ $seed = 1 ] && t=1.303
  .venv/bin/python -m commpress race --local 2 --config $D/h1_lr1.2.toml --config $D/h1_lr1.7.toml --config $D/h1_lr2.0.toml --target $t --max-steps 440 --eval-every 10 --seed $seed --json $D/lr_seed$seed.json > $D/lr_seed$seed.log 2>&1
done
