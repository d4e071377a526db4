"""Turn every rank's raw measurements into per-method rows: table, JSON and a bar chart.

A synchronous step is as slow as its slowest rank, so each step's time is the maximum over
ranks; the row gives the median and quartiles of those. Bytes and compression time are
means over ranks per step. "network" is what is left of the step once the computation
alone (same steps without DDP) and the compression time are taken out: time spent waiting
for collectives that compression and computation did not hide. A run whose ranks share one
host over links without a limit gets a note: there the network is never the bottleneck.

A ``[layerwise]`` row also says what its planning cost (means over ranks, wall time):
measuring the candidates' errors on a measured step plus making the plan at the next step,
per plan over the whole run (warm-up included); that cost as a share of ``every`` median
steps (the *amortised* share: one plan per ``every`` steps); and the planning time inside
the timed steps as a share of their summed time (the *timed* share, which depends on
whether a plan falls among them).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from commpress.terminal import format_table

__all__ = ["LOOPBACK_NOTE", "format_report", "pyplot", "summarize", "write_json", "write_plot"]

#: Printed under the table of a run on one host without a link limit.
LOOPBACK_NOTE = (
    "note: these ranks talk over loopback with no link limit, so sending bytes costs almost nothing here; "
    "compression pays only when the network is the bottleneck. Measure on throttled links with "
    "`sudo commpress linkemu --ranks 2 --rate 100mbit -- python -m commpress bench --scale 0.05`."
)
#: ``COMMPRESS_LINK`` values (set by ``commpress linkemu``) of links without a limit; unset is "local".
_UNLIMITED = ("local", "unlimited")


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The report as plain data: run settings plus one dict per method."""
    ranks = raw["ranks"]
    steps = raw["steps"]
    compute = [max(ts) for ts in zip(*(r["compute_seconds"] for r in ranks))]
    compute_median = statistics.median(compute)
    grad_bytes = raw["workload"]["grad_bytes"]
    rows = []
    for i, first in enumerate(ranks[0]["methods"]):
        per_rank = [r["methods"][i] for r in ranks]
        step = [max(ts) for ts in zip(*(m["step_seconds"] for m in per_rank))]
        q1, median, q3 = _quantiles(step)
        sent = statistics.fmean(m["bytes_sent"] for m in per_rank) / steps
        compress = statistics.fmean(m["compute_seconds"] for m in per_rank) / steps
        rows.append(
            {
                "label": first["label"],
                "kind": first["kind"],
                "note": first["note"],
                "bucket_cap_mb": first["bucket_cap_mb"],
                "step_seconds_median": median,
                "step_seconds_q1": q1,
                "step_seconds_q3": q3,
                "step_seconds_min": min(step),
                "step_seconds_max": max(step),
                "bytes_per_step": sent,
                "compression": grad_bytes / sent if sent else None,
                "compress_seconds": compress,
                "network_seconds": max(0.0, median - compute_median - compress),
                "layerwise": _planning(per_rank, step, median),
            }
        )
    reference = next((r for r in rows if r["kind"] == "ddp"), rows[0] if rows else None)
    for r in rows:
        r["speedup"] = reference["step_seconds_median"] / r["step_seconds_median"] if reference else None
    link = raw.get("link", "local")
    return {
        "link": link,
        "loopback": link in _UNLIMITED and len({r.get("host") for r in ranks}) == 1,
        "workload": raw["workload"],
        "world_size": raw["world_size"],
        "steps": steps,
        "warmup": raw["warmup"],
        "interleaved": raw.get("interleaved", False),
        "compute_seconds_median": compute_median,
        "reference": reference["label"] if reference else None,
        "methods": rows,
    }


def _planning(per_rank: list[dict[str, Any]], step: list[float], median: float) -> dict[str, Any] | None:
    """A ``[layerwise]`` row's planning cost (module docstring); None for other rows."""
    if per_rank[0].get("layerwise") is None:
        return None
    every = per_rank[0]["layerwise"]["every"]
    run = [m["layerwise"]["run"] for m in per_rank]
    timed = [m["layerwise"]["timed"] for m in per_rank]
    measured, plans = run[0]["measured_steps"], run[0]["plans"]
    measure = statistics.fmean(r["measure_seconds"] for r in run) / measured if measured else None
    plan = statistics.fmean(r["plan_seconds"] for r in run) / plans if plans else None
    per_plan = measure + plan if measure is not None and plan is not None else None
    timed_seconds = statistics.fmean(t["measure_seconds"] + t["plan_seconds"] for t in timed)
    return {
        "every": every,
        "measured_steps": measured,
        "plans": plans,
        "measure_seconds_per_plan": measure,
        "plan_seconds_per_plan": plan,
        "amortised_share": per_plan / (every * median) if per_plan is not None else None,
        "timed_measured_steps": timed[0]["measured_steps"],
        "timed_plans": timed[0]["plans"],
        "timed_seconds": timed_seconds,
        "timed_share": timed_seconds / sum(step),
    }


def _planning_line(label: str, p: dict[str, Any]) -> str:
    """One line under the table: what a ``[layerwise]`` row's planning cost."""
    if p["amortised_share"] is None:
        return f"layer-wise planning of {label}: no plan made in this run ({p['measured_steps']} measured steps)"
    return (
        f"layer-wise planning of {label}: {1000 * p['measure_seconds_per_plan']:.1f} ms measuring + "
        f"{1000 * p['plan_seconds_per_plan']:.1f} ms planning per plan ({p['plans']} plans), "
        f"{100 * p['amortised_share']:.2f}% of {p['every']} median steps (amortised); "
        f"{100 * p['timed_share']:.2f}% of the timed steps' time ({p['timed_measured_steps']} measured, "
        f"{p['timed_plans']} planned among them)"
    )


def format_report(summary: dict[str, Any]) -> str:
    """A header line and the table, for the terminal."""
    w = summary["workload"]
    head = (
        f"workload {w['name']} (scale {w['scale']}, {w['numel']:,} parameters, {w['grad_bytes'] / 2**20:.1f} MiB of gradient), "
        f"{summary['world_size']} ranks, link {summary['link']}, "
        f"{summary['steps']} timed steps after {summary['warmup']} warm-up"
        f"{' (rows interleaved step by step)' if summary.get('interleaved') else ''}; "
        f"computation alone {1000 * summary['compute_seconds_median']:.1f} ms/step"
    )
    table = []
    for r in summary["methods"]:
        label = f"{r['label']} ({r['note']})" if r["note"] else r["label"]
        table.append(
            [
                label,
                f"{1000 * r['step_seconds_median']:.1f}",
                f"{1000 * r['step_seconds_q1']:.1f}-{1000 * r['step_seconds_q3']:.1f}",
                f"{r['bytes_per_step']:,.0f}",
                f"{r['compression']:.1f}x" if r["compression"] else "-",
                f"{1000 * r['compress_seconds']:.1f}",
                f"{1000 * r['network_seconds']:.1f}",
                f"{r['speedup']:.2f}x",
            ]
        )
    headers = ["method", "step ms", "IQR ms", "bytes/step/rank", "compression", "compress ms", "network ms", "speed-up"]
    text = head + "\n" + format_table(headers, table) + f"\n(speed-up over {summary['reference']})"
    for r in summary["methods"]:
        if r.get("layerwise") is not None:
            text += "\n" + _planning_line(r["label"], r["layerwise"])
    return text + "\n" + LOOPBACK_NOTE if summary.get("loopback") else text


def write_json(summary: dict[str, Any], path: str) -> None:
    """The summary as JSON (``-``: standard output)."""
    text = json.dumps(summary, indent=2)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (the Agg backend); a clear error without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (commpress's bench extra)") from None
    return plt


def write_plot(summary: dict[str, Any], path: str) -> None:
    """A PNG bar chart of median step time per method, split into computation,
    compression and network wait (needs matplotlib, commpress's ``bench`` extra)."""
    plt = pyplot()
    rows = summary["methods"]
    labels = [r["label"] for r in rows]
    compute = [1000 * summary["compute_seconds_median"]] * len(rows)
    compress = [1000 * r["compress_seconds"] for r in rows]
    network = [1000 * r["network_seconds"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4.5))
    ax.bar(labels, compute, label="computation")
    ax.bar(labels, compress, bottom=compute, label="compress/decompress")
    ax.bar(labels, network, bottom=[a + b for a, b in zip(compute, compress)], label="network wait")
    ax.scatter(labels, [1000 * r["step_seconds_median"] for r in rows], color="black", zorder=3, label="median step")
    w = summary["workload"]
    ax.set_title(f"{w['name']} scale {w['scale']}, {summary['world_size']} ranks")
    ax.set_ylabel("ms per step")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
