"""Turn a race's curves into rows: time and steps to the target, speed-ups, the two
factors of each speed-up and the ceiling, table, JSON, plot.

A method reaches the target at its first evaluation at or below it; with ``smooth`` = k > 1,
at the first evaluation whose centred mean over k evaluations is (the target is then ddp's
centred mean at ``target_steps`` too): late in a run the curve is so flat that one
evaluation's noise moves a single-point crossing by several evaluations, in either
direction. The time is the clock at that evaluation (training steps only, evaluation
excluded), so it is known to ``eval_every`` steps.
A method that never gets there stays in the table, marked "not reached" with its best
loss and the steps it ran (or "diverged": a non-finite average stopped it), with ``None`` for its time and steps in the JSON.

Beside it, every row's held-out loss at ``target_steps`` (the end of ddp's run: under the
default schedule, where the learning rate has decayed), smoothed as the target is, and its
gap to ddp's there: the quality a method costs at equal steps, which a time to a target
reached early in the decay can hide.

Time to target = steps to target x step time, so each row's speed-up over ``ddp`` has two
factors, both reported: its steps to target / ddp's, and its step time / ddp's. The
ceiling, ddp's step time / the computation alone's (measured in the same run), is the
most a row that needs ddp's steps can win.
"""

from __future__ import annotations

from typing import Any

from commpress.bench.report import pyplot, write_json
from commpress.terminal import format_table

__all__ = ["crossing", "format_report", "reference_target", "summarize", "write_json", "write_plot"]

#: ``COMMPRESS_LINK`` values of links without a limit (unset is "local").
_UNLIMITED = ("local", "unlimited")


Point = tuple[int, float, float]


def _centred(curve: list[Point], i: int, smooth: int) -> float | None:
    """The mean loss of the ``smooth`` points centred on point ``i``; None where the curve
    does not reach that far on both sides."""
    half = smooth // 2
    if i < half or i + half >= len(curve):
        return None
    return sum(p[2] for p in curve[i - half : i + half + 1]) / smooth


def crossing(curve: list[Point], target: float, smooth: int = 1) -> int | None:
    """The index of the first (step, seconds, loss) point of ``curve`` whose centred mean
    over ``smooth`` points is at or below ``target``; None before there is one."""
    return next((i for i in range(len(curve)) if (m := _centred(curve, i, smooth)) is not None and m <= target), None)


def reference_target(curve: list[Point], steps: int, smooth: int = 1) -> float:
    """The reference run's held-out loss after ``steps`` steps: the centred mean over
    ``smooth`` evaluations of its point at ``steps``."""
    i = next(i for i, p in enumerate(curve) if p[0] == steps)
    mean = _centred(curve, i, smooth)
    if mean is None:
        raise ValueError(f"the curve does not reach {smooth // 2} evaluations past step {steps}")
    return mean


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The race as plain data: its settings, the computation alone's step time, the
    ceiling, and one row per method, in run order."""
    target = raw["target"]
    rows = [_row(r, target, raw.get("smooth", 1), raw.get("target_steps")) for r in raw["rows"]]
    for key, kind in (("speedup_over_ddp", "ddp"), ("speedup_over_torch_powersgd", "torch-powersgd")):
        reference = next((r for r in rows if r["kind"] == kind), None)
        for r in rows:  # a time of 0 s (the target met at the start) gives no speed-up
            r[key] = _ratio(None if reference is None else reference["time_to_target_s"], r["time_to_target_s"])
    ddp = next((r for r in rows if r["kind"] == "ddp"), {"steps_to_target": None, "seconds_per_step": None})
    ddp_loss = ddp.get("loss_at_target_steps")
    for r in rows:
        at = r["loss_at_target_steps"]
        r["loss_vs_ddp"] = at / ddp_loss - 1 if at is not None and ddp_loss else None
        r["steps_vs_ddp"] = _ratio(r["steps_to_target"], ddp["steps_to_target"])
        r["step_time_vs_ddp"] = _ratio(r["seconds_per_step"], ddp["seconds_per_step"])
    compute = raw["compute_only"]["seconds"] / raw["compute_only"]["steps"]
    return {
        **{k: v for k, v in raw.items() if k != "rows"},
        "compute_seconds_per_step": compute,
        "ceiling": _ratio(ddp["seconds_per_step"], compute),
        "rows": rows,
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None where either is unknown or the denominator is 0."""
    return numerator / denominator if numerator is not None and denominator else None


def _loss_at(curve: list[Point], steps: int | None, smooth: int) -> float | None:
    """:func:`reference_target` of any row; None where its curve has no centred point at ``steps``."""
    if steps is None or not any(p[0] == steps for p in curve):
        return None
    try:
        return reference_target(curve, steps, smooth)
    except ValueError:  # stopped too soon after it (a time cap, a divergence)
        return None


def _row(raw: dict[str, Any], target: float, smooth: int, target_steps: int | None) -> dict[str, Any]:
    curve = [{"step": s, "seconds": t, "loss": loss} for s, t, loss in raw["curve"]]
    i = crossing(raw["curve"], target, smooth)
    hit = None if i is None else curve[i]
    last = curve[-1]
    return {
        "method": raw["method"],
        "kind": raw["kind"],
        "note": raw["note"],
        "bucket_cap_mb": raw["bucket_cap_mb"],
        "time_to_target_s": hit["seconds"] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "final_loss": last["loss"],
        "loss_at_target_steps": _loss_at(raw["curve"], target_steps, smooth),
        "best_loss": min(p["loss"] for p in curve),
        "steps": last["step"],
        "seconds": last["seconds"],
        "seconds_per_step": last["seconds"] / last["step"] if last["step"] else None,
        "bytes_per_step": raw["bytes_per_step"],
        "diverged": raw.get("diverged"),
        "curve": curve,
    }


def _label(row: dict[str, Any]) -> str:
    return f"{row['method']} ({row['note']})" if row["note"] else row["method"]


def _smoothing(smooth: int) -> str:
    return "" if smooth == 1 else f", each crossing on the centred mean of {smooth} evaluations"


def _times(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def _schedule(summary: dict[str, Any]) -> str:
    """The learning rate's schedule (a race saved before schedules: its constant lr)."""
    return summary.get("schedule") or f"constant lr {summary['lr']:g}"


def _rest(summary: dict[str, Any]) -> str:
    """Under muon, AdamW's peak learning rate on what Muon does not step."""
    rest = summary.get("rest_lr")
    return f" (AdamW at {rest:g} on the embeddings, head, norms and biases)" if rest is not None else ""


def _loss(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "-"


def _ms(seconds: float | None) -> str:
    return f"{1000 * seconds:.0f}" if seconds else "-"


def _ranks(summary: dict[str, Any]) -> str:
    """``4 ranks``, or ``4 ranks (2 groups x 2 shards, ddp = HSDP)`` for a sharded race."""
    world, shards = summary["world_size"], summary.get("shards", 1)
    return f"{world} ranks" + (f" ({world // shards} groups x {shards} shards, ddp = HSDP)" if shards > 1 else "")


def format_report(summary: dict[str, Any]) -> str:
    """A header line, the table and how to read it, for the terminal."""
    task = summary["task"]
    compute = summary["compute_seconds_per_step"]
    ceiling = summary["ceiling"]
    head = (
        f"task {task['name']} ({task['numel']:,} parameters, {task['grad_bytes'] / 2**20:.1f} MiB of gradient), "
        f"{_ranks(summary)}, link {summary['link']}, {summary['optimizer']} {_schedule(summary)}{_rest(summary)}; "
        f"target held-out loss {summary['target']:.4f} ({summary['target_source']}), evaluated every "
        f"{summary['eval_every']} steps{_smoothing(summary.get('smooth', 1))}; time counts training steps only"
    )
    if ceiling is not None:
        head += (
            f"\nceiling {ceiling:.2f}x: ddp's step time / the computation alone's ({_ms(compute)} ms/step, no "
            "communication); a row that needs ddp's steps can be at most this much sooner than ddp"
        )
    table = [
        [
            _label(r),
            f"{r['time_to_target_s']:.1f}"
            if r["time_to_target_s"] is not None
            else f"diverged at step {r['diverged']['step']} (best {r['best_loss']:.3f})"
            if r["diverged"]
            else f"not reached (best {r['best_loss']:.3f} in {r['steps']} steps)",
            _times(r["speedup_over_ddp"]),
            _times(r["speedup_over_torch_powersgd"]),
            "-" if r["steps_to_target"] is None else str(r["steps_to_target"]),
            _times(r["steps_vs_ddp"]),
            _ms(r["seconds_per_step"]),
            _times(r["step_time_vs_ddp"]),
            f"{r['bytes_per_step']:,.0f}",
            _loss(r["loss_at_target_steps"]),
            "-" if r["loss_vs_ddp"] is None else f"{100 * r['loss_vs_ddp']:+.2f}%",
        ]
        for r in summary["rows"]
    ]
    alone = _times(1 / ceiling) if ceiling is not None else "-"
    table.append(["computation alone (no communication)", "-", "-", "-", "-", "-", _ms(compute), alone, "0", "-", "-"])
    headers = [
        "method",
        "time to target s",
        "vs ddp",
        "vs torch-powersgd",
        "steps to target",
        "steps / ddp's",
        "ms/step",
        "step time / ddp's",
        "bytes/step/rank",
        f"loss at {summary.get('target_steps', '-')}",
        "vs ddp's",
    ]
    text = head + "\n" + format_table(headers, table)
    text += (
        "\ntime to target = steps to target x ms/step, so where both rows stopped at the target, "
        "vs ddp = 1 / (steps / ddp's x step time / ddp's)"
    )
    if summary["link"] in _UNLIMITED:
        text += (
            "\nnote: no link limit here, so sending bytes costs almost nothing; measure on throttled links with "
            "`sudo commpress linkemu --ranks 2 --rate 100mbit -- python -m commpress race`."
        )
    return text


def write_plot(summary: dict[str, Any], path: str) -> None:
    """A PNG of held-out loss against wall-clock seconds, one line per method labelled
    with its two factors, the target dashed, the ceiling in the title (needs matplotlib,
    commpress's ``bench`` extra)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in summary["rows"]:
        label = f"{_label(r)}: steps {_times(r['steps_vs_ddp'])}, step time {_times(r['step_time_vs_ddp'])} ddp's"
        (line,) = ax.plot([p["seconds"] for p in r["curve"]], [p["loss"] for p in r["curve"]], label=label)
        if r["time_to_target_s"] is not None:
            ax.plot([r["time_to_target_s"]], [summary["target"]], "o", color=line.get_color())
    ax.axhline(summary["target"], color="black", linestyle="--", linewidth=1, label=f"target {summary['target']:.3f}")
    task = summary["task"]
    ax.set_title(
        f"{task['name']} ({task['numel']:,} parameters), {_ranks(summary)}, link {summary['link']}; "
        f"ceiling {_times(summary['ceiling'])}",
        fontsize="medium",
    )
    ax.set_xlabel("wall-clock seconds (training steps only)")
    ax.set_ylabel("held-out loss")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
