"""Steps to a target read off race curves, as the race reads them (the first evaluation whose
centred mean of 5 is at or below the target): python crossings.py TARGET_JSON CURVE_JSON...
(the target: the DDP row's of TARGET_JSON)."""

import json
import sys
from pathlib import Path


def curve(path: str) -> dict[int, float]:
    row = json.loads(Path(path).read_text())["rows"][0]
    return {p["step"]: p["loss"] for p in row["curve"]}


def centred(losses: dict[int, float], step: int, every: int = 10) -> float | None:
    window = [losses.get(step + k * every) for k in range(-2, 3)]
    return None if None in window else sum(window) / 5


target = json.loads(Path(sys.argv[1]).read_text())["target"]
for path in sys.argv[2:]:
    losses = curve(path)
    cross = next((s for s in sorted(losses) if (c := centred(losses, s)) is not None and c <= target), None)
    print(f"{path}: target {target:.4f}, crossed at step {cross}")
