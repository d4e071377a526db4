"""Steps to a target read off race curves by the race's own rule
(:func:`commpress.bench.race_report.crossing`, the JSON's ``smooth``):
python crossings.py TARGET_JSON CURVE_JSON... (the target: TARGET_JSON's)."""

import json
import sys
from pathlib import Path

from commpress.bench.race_report import crossing

target = json.loads(Path(sys.argv[1]).read_text())["target"]
for path in sys.argv[2:]:
    race = json.loads(Path(path).read_text())
    curve = [(p["step"], p["seconds"], p["loss"]) for p in race["rows"][0]["curve"]]
    i = crossing(curve, target, race["smooth"])
    print(f"{path}: target {target:.4f}, crossed at step {None if i is None else curve[i][0]}")
