"""The Muon column as one table: each ready config's loss at step 400 and steps to DDP +
Muon's step-400 loss, beside DDP + Muon's, seed 0 / seed 1 where both ran: this folder's
runs (run.sh) and the earlier ones of benchmarks/results/muon_2026-12-02 and
muon_variants_2026-12-02 (:data:`EARLIER`).  python3 table.py"""

import json
from pathlib import Path

HERE = Path(__file__).parent
DAY = HERE.parent / "muon_2026-12-02"
VARIANTS = HERE.parent / "muon_variants_2026-12-02"
#: seed -> DDP + Muon's run at 8e-3
DDP = {"0": DAY / "screen_lr8e-3_seed0.json", "1": DAY / "rows_lr8e-3_seed1.json"}
#: config -> seed -> (an earlier run's JSON, its row's method)
EARLIER = {
    "slow-link": {"0": (DAY / "slow_lr8e-3_seed0.json", "slow-link"), "1": (DAY / "rows_lr8e-3_seed1.json", "slow-link")},
    "slow-link-h1": {"0": (VARIANTS / "slow-link-h1_seed0.json", "slow-link-h1")},
    "slow-link-muon": {"0": (VARIANTS / "slow-link-muon_seed0.json", "slow-link-h1-one")},
    "dion": {"0": (VARIANTS / "dion16_seed0.json", "dion")},
}


def _row(path: Path, method: str | None = None) -> dict:
    rows = json.loads(path.read_text())["rows"]
    return rows[0] if method is None else next(r for r in rows if r["method"] == method)


ddp = {s: _row(p, "ddp") for s, p in DDP.items()}
names = sorted({p.name.rsplit("_seed", 1)[0] for p in HERE.glob("*_seed*.json")} | set(EARLIER))
print("| config | loss at 400 vs DDP + Muon, seed 0 / 1 | steps to its loss / DDP's | bytes per step vs DDP |")
print("|---|---|---|---|")
for name in names:
    gaps, steps, fewer = [], [], ""
    for seed in ("0", "1"):
        path = HERE / f"{name}_seed{seed}.json"
        if path.exists():
            row = _row(path)
        elif seed in EARLIER.get(name, {}):
            row = _row(*EARLIER[name][seed])
        else:
            continue
        gaps.append(f"{row['loss_at_target_steps'] / ddp[seed]['loss_at_target_steps'] - 1:+.1%}")
        steps.append(f"{row['steps_to_target'] / 400:.2f}x" if row["steps_to_target"] else f"not in {row['steps']}")
        sent = row["bytes_per_step"]
        fewer = f"{ddp[seed]['bytes_per_step'] / sent:.1f}x fewer" if sent else "not counted by the race"
    print(f"| {name} | {' / '.join(gaps)} | {' / '.join(steps)} | {fewer} |")
