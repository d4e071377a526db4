"""The ROWS=each runs as one table: each row's loss at step 400 and steps to the target
beside DDP's (the seed's DDP row of an earlier run: lr2_seed0.json for seed 0)."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
seed = sys.argv[1] if len(sys.argv) > 1 else "0"
ddp = json.loads((HERE / f"lr2_seed{seed}.json").read_text())["rows"][0]
assert ddp["method"] == "ddp"
print("| row | loss at 400 vs DDP's | steps to DDP's 400-step loss / DDP's | bytes per step vs DDP |")
print("|---|---|---|---|")
for path in sorted(HERE.glob(f"each_*_seed{seed}.json")):
    row = json.loads(path.read_text())["rows"][0]
    gap = row["loss_at_target_steps"] / ddp["loss_at_target_steps"] - 1
    steps = f"{row['steps_to_target'] / 400:.2f}x" if row["steps_to_target"] else f"not in {row['steps']}"
    print(f"| {row['method']} | {gap:+.2%} | {steps} | {ddp['bytes_per_step'] / row['bytes_per_step']:.1f}x fewer |")
