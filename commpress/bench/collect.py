"""Combine ``commpress bench --json`` files into markdown tables for the docs.

``python -m commpress.bench.collect results/*.json`` prints one table of median step time
and speed-up over plain all-reduce per method (rows) and run (columns: ranks and link),
and one of bytes per step and compression per method. Each run's numbers were measured
side by side in one process, so compare within a column.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "markdown_tables"]


def _markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _label(method: dict[str, Any]) -> str:
    return f"{method['label']} ({method['note']})" if method.get("note") else method["label"]


def markdown_tables(summaries: Sequence[dict[str, Any]]) -> str:
    """Step-time table and bytes table of ``summaries`` (from :func:`report.summarize`)."""
    runs = sorted(summaries, key=lambda s: (s["world_size"], s.get("link", "local")))
    labels: list[str] = []
    for s in runs:
        labels += [_label(m) for m in s["methods"] if _label(m) not in labels]
    headers = ["method", *(f"{s['world_size']} ranks, {s.get('link', 'local')}" for s in runs)]
    time_rows = []
    for label in labels:
        row = [label]
        for s in runs:
            m = next((m for m in s["methods"] if _label(m) == label), None)
            row.append("-" if m is None else f"{1000 * m['step_seconds_median']:.0f} ms ({m['speedup']:.2f}x)")
        time_rows.append(row)
    byte_rows = []
    for label in labels:
        m = next(m for s in runs for m in s["methods"] if _label(m) == label)
        ratio = f"{m['compression']:.1f}x" if m["compression"] else "-"
        byte_rows.append([label, f"{m['bytes_per_step']:,.0f}", ratio])
    w = runs[0]["workload"]
    head = (
        f"Workload {w['name']} at scale {w['scale']} ({w['numel']:,} parameters), {runs[0]['steps']} timed steps "
        f"after {runs[0]['warmup']} warm-up; median step time (speed-up over {runs[0]['reference']}):"
    )
    return (
        head
        + "\n\n"
        + _markdown(headers, time_rows)
        + "\n\nBytes each rank sends per step (first run):\n\n"
        + _markdown(["method", "bytes/step/rank", "compression"], byte_rows)
    )


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print("usage: python -m commpress.bench.collect RESULT.json ...", file=sys.stderr)
        return 2
    print(markdown_tables([json.loads(Path(p).read_text()) for p in paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
