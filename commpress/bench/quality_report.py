"""The quality suite's report: a row per (task, optimizer, method) over seeds, as a table and a plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from commpress.bench.quality import QualityRun
from commpress.errors import ConfigError
from commpress.terminal import format_table

__all__ = ["Summary", "render", "summarize", "write_plot"]


@dataclass(frozen=True)
class Summary:
    """One table row: a method's final held-out loss and its gap to ``none`` (relative,
    per seed, then mean / min / max over seeds); NaN where it could not run."""

    task: str
    optimizer: str
    method: str
    bytes_per_step: float
    loss: float
    gap_mean: float
    gap_min: float
    gap_max: float
    error: str | None


def summarize(runs: Sequence[QualityRun]) -> list[Summary]:
    """Rows in run order: per (task, optimizer, method) over seeds."""
    ref = {(r.task, r.optimizer, r.seed): r.eval_loss for r in runs if r.method == "none"}
    keyed: dict[tuple[str, str, str], list[QualityRun]] = {}
    for r in runs:
        keyed.setdefault((r.task, r.optimizer, r.method), []).append(r)
    rows = []
    for (task, optimizer, method), group in keyed.items():
        gaps = [(r.eval_loss - ref[task, optimizer, r.seed]) / ref[task, optimizer, r.seed] for r in group]
        error = next((r.error for r in group if r.error), None)
        rows.append(
            Summary(
                task,
                optimizer,
                method,
                statistics.fmean(r.bytes_per_step for r in group),
                statistics.fmean(r.eval_loss for r in group),
                statistics.fmean(gaps),
                min(gaps),
                max(gaps),
                error,
            )
        )
    return rows


def render(rows: Sequence[Summary], seeds: int) -> str:
    """The table, and under it why each n/a row could not run (rows with the same reason together)."""
    table, reasons = [], {}
    for s in rows:
        if s.error:
            reasons.setdefault(s.error, []).append(f"{s.task}/{s.optimizer}/{s.method}")
            table.append([s.task, s.optimizer, s.method, "n/a", "n/a", "n/a", "n/a"])
            continue
        spread = f"{100 * s.gap_min:+.2f}% .. {100 * s.gap_max:+.2f}%"
        table.append(
            [s.task, s.optimizer, s.method, f"{s.bytes_per_step:,.0f}", f"{s.loss:.4f}", f"{100 * s.gap_mean:+.2f}%", spread]
        )
    headers = [
        "task",
        "optimizer",
        "method",
        "bytes/step/rank",
        "final loss",
        "gap vs none",
        f"min .. max ({seeds} seed{'s' if seeds != 1 else ''})",
    ]
    notes = [f"n/a ({', '.join(where)}): {error}" for error, where in reasons.items()]
    return "\n".join([format_table(headers, table), *notes])


def write_plot(rows: Sequence[Summary], path: str) -> None:
    """One panel per (task, optimizer): the mean gap to ``none`` per method, with the
    seeds' min .. max as error bars (needs matplotlib: ``pip install 'commpress[bench]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'commpress[bench]'") from None
    panels: dict[tuple[str, str], list[Summary]] = {}
    for s in rows:
        panels.setdefault((s.task, s.optimizer), []).append(s)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), squeeze=False)
    for ax, ((task, optimizer), group) in zip(axes[:, 0], panels.items()):
        x = range(len(group))
        means = [math.nan if s.error else 100 * s.gap_mean for s in group]
        low = [0.0 if s.error else 100 * (s.gap_mean - s.gap_min) for s in group]
        high = [0.0 if s.error else 100 * (s.gap_max - s.gap_mean) for s in group]
        ax.bar(x, means, yerr=[low, high], capsize=3, color="tab:blue")
        for i, s in enumerate(group):
            if s.error:
                ax.text(i, 0, "n/a", ha="center", va="bottom")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(list(x), [s.method for s in group], rotation=30)
        ax.set_title(f"{task}, {optimizer}")
        ax.set_ylabel("gap vs none (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
