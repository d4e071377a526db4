"""Each demo row's bytes per step and held-out loss, before (2d779c4) and after: equal to the bit?"""

import json
from pathlib import Path

HERE = Path(__file__).parent
before, after = (json.loads((HERE / f"demo_{n}.json").read_text()) for n in ("2d779c4", "after"))
for a, b in zip(before, after, strict=True):
    same = a["bytes_per_step"] == b["bytes_per_step"] and a["eval_loss"] == b["eval_loss"]
    print(f"{a['label']:14s} bytes {a['bytes_per_step']:>12,.1f}  loss {a['eval_loss']:.10f}  {'same' if same else 'DIFFERENT'}")
