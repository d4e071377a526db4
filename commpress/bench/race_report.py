"""Turn a race's curves into rows: time and steps to the target, speed-ups, table, JSON, plot.

A method reaches the target at its first evaluation at or below it; the time is its clock
there (training steps only, evaluation excluded), so it is known to ``eval_every`` steps.
A method that never gets there stays in the table, marked "not reached", with ``None``
for its time and steps in the JSON.
"""

from __future__ import annotations

from typing import Any

from commpress.bench.report import pyplot, write_json
from commpress.terminal import format_table

__all__ = ["format_report", "summarize", "write_json", "write_plot"]

#: ``COMMPRESS_LINK`` values of links without a limit (unset is "local").
_UNLIMITED = ("local", "unlimited")


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The race as plain data: its settings and one row per method, in run order."""
    target = raw["target"]
    rows = [_row(r, target) for r in raw["rows"]]
    for key, kind in (("speedup_over_ddp", "ddp"), ("speedup_over_torch_powersgd", "torch-powersgd")):
        reference = next((r for r in rows if r["kind"] == kind), None)
        for r in rows:
            theirs = None if reference is None else reference["time_to_target_s"]
            known = theirs is not None and r["time_to_target_s"]  # 0 s: the target was met at the start
            r[key] = theirs / r["time_to_target_s"] if known else None
    return {**{k: v for k, v in raw.items() if k != "rows"}, "rows": rows}


def _row(raw: dict[str, Any], target: float) -> dict[str, Any]:
    curve = [{"step": s, "seconds": t, "loss": loss} for s, t, loss in raw["curve"]]
    hit = next((p for p in curve if p["loss"] <= target), None)
    last = curve[-1]
    return {
        "method": raw["method"],
        "kind": raw["kind"],
        "note": raw["note"],
        "bucket_cap_mb": raw["bucket_cap_mb"],
        "time_to_target_s": hit["seconds"] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "final_loss": last["loss"],
        "steps": last["step"],
        "seconds": last["seconds"],
        "seconds_per_step": last["seconds"] / last["step"] if last["step"] else None,
        "bytes_per_step": raw["bytes_per_step"],
        "curve": curve,
    }


def _label(row: dict[str, Any]) -> str:
    return f"{row['method']} ({row['note']})" if row["note"] else row["method"]


def _speedup(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def format_report(summary: dict[str, Any]) -> str:
    """A header line, the table and how to read it, for the terminal."""
    task = summary["task"]
    head = (
        f"task {task['name']} ({task['numel']:,} parameters, {task['grad_bytes'] / 2**20:.1f} MiB of gradient), "
        f"{summary['world_size']} ranks, link {summary['link']}, {summary['optimizer']} lr {summary['lr']:g}; "
        f"target held-out loss {summary['target']:.4f} ({summary['target_source']}), evaluated every "
        f"{summary['eval_every']} steps; time counts training steps only"
    )
    table = [
        [
            _label(r),
            "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}",
            _speedup(r["speedup_over_ddp"]),
            _speedup(r["speedup_over_torch_powersgd"]),
            "not reached" if r["steps_to_target"] is None else str(r["steps_to_target"]),
            str(r["steps"]),
            f"{1000 * r['seconds_per_step']:.0f}" if r["seconds_per_step"] else "-",
            f"{r['bytes_per_step']:,.0f}",
            f"{r['final_loss']:.4f}",
        ]
        for r in summary["rows"]
    ]
    headers = [
        "method",
        "time to target s",
        "vs ddp",
        "vs torch-powersgd",
        "steps to target",
        "steps run",
        "ms/step",
        "bytes/step/rank",
        "final loss",
    ]
    text = head + "\n" + format_table(headers, table)
    if summary["link"] in _UNLIMITED:
        text += (
            "\nnote: no link limit here, so sending bytes costs almost nothing; measure on throttled links with "
            "`sudo commpress linkemu --ranks 2 --rate 100mbit -- python -m commpress race`."
        )
    return text


def write_plot(summary: dict[str, Any], path: str) -> None:
    """A PNG of held-out loss against wall-clock seconds, one line per method, the target
    dashed (needs matplotlib, commpress's ``bench`` extra)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in summary["rows"]:
        (line,) = ax.plot([p["seconds"] for p in r["curve"]], [p["loss"] for p in r["curve"]], label=_label(r))
        if r["time_to_target_s"] is not None:
            ax.plot([r["time_to_target_s"]], [summary["target"]], "o", color=line.get_color())
    ax.axhline(summary["target"], color="black", linestyle="--", linewidth=1, label=f"target {summary['target']:.3f}")
    task = summary["task"]
    ax.set_title(f"{task['name']} ({task['numel']:,} parameters), {summary['world_size']} ranks, link {summary['link']}")
    ax.set_xlabel("wall-clock seconds (training steps only)")
    ax.set_ylabel("held-out loss")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
