"""Train the demo model on N local ranks with each compressor and compare them.

Next-character prediction on Python's own standard-library sources (no downloads), DDP
on gloo (CPU), the same seed and data for every method. The table shows bytes each rank
sends per step, the compression ratio against ``none``, the median step time, the
held-out loss at the end and its gap to ``none``; a method that never compressed (its
``start_iter`` is not below ``--steps``) is marked and named under the table. ``--json``
also writes every row with its loss at full precision. Example::

    commpress demo --steps 100 --methods "none,powersgd,topk:ratio=0.03"
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from commpress.bench.arguments import LIST_HELP, integer, method_list
from commpress.bench.progress import Progress
from commpress.cmdline import parse_method_spec
from commpress.errors import ConfigError
from commpress.terminal import format_table

__all__ = ["DEFAULT_STEPS", "DEMO_ROWS", "DemoRow", "add_arguments", "demo_rows", "progress_labels", "render", "run"]

DEFAULT_STEPS = 200


@dataclass(frozen=True)
class DemoRow:
    """One line of the demo table: a label and the commpress config it trains with."""

    label: str
    config: dict[str, Any]


def demo_rows(steps: int) -> list[DemoRow]:
    """The methods the demo compares for a run of ``steps``, in table order; the first row
    is the reference. The low-rank rows run plain all-reduce for their first 10% of the
    steps (20 of the default 200), as PyTorch recommends for its PowerSGD hook
    (start_powerSGD_iter): early gradients change too fast."""
    start = steps // 10
    return [
        DemoRow("none", {"method": "none"}),
        DemoRow("fp16", {"method": "fp16"}),
        DemoRow("bf16", {"method": "bf16"}),
        DemoRow("powersgd", {"method": "powersgd", "start_iter": start, "params": {"rank": 4}}),
        DemoRow("acpsgd", {"method": "acpsgd", "start_iter": start, "params": {"rank": 4}}),
        DemoRow("terngrad", {"method": "terngrad"}),
        DemoRow("topk", {"method": "topk", "params": {"ratio": 0.01}}),
        DemoRow("local-sgd+qsr", {"method": "none", "local_sgd": {"period": 4, "qsr_alpha": 0.2}}),
        DemoRow("co2", {"method": "bf16", "local_sgd": {"algorithm": "co2", "period": 5, "outer_lr": 0.7}}),
    ]


#: The rows of a run of the default length (the README's table).
DEMO_ROWS = demo_rows(DEFAULT_STEPS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=integer(1), default=2, help="local ranks to start (default 2)")
    parser.add_argument(
        "--steps",
        type=integer(1),
        default=DEFAULT_STEPS,
        help=f"training steps per method (default {DEFAULT_STEPS}); the low-rank rows start compressing after 10%% of them",
    )
    parser.add_argument(
        "--methods",
        type=method_list(),
        help=f"{LIST_HELP}; a name of a demo row ({', '.join(r.label for r in DEMO_ROWS)}) is that row, anything else "
        "a method spec, e.g. 'none;powersgd:rank=2,start_iter=5;topk' (default: every demo row)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the rows (label, bytes_per_step, step_seconds, eval_loss at full precision) as JSON",
    )


def _rank_main(rank: int, world: int, rows: list[DemoRow], steps: int) -> list[dict[str, Any]]:
    from commpress.workloads.train import train_ddp

    out = []
    for row, label in zip(rows, progress_labels([row.label for row in rows])):
        bar = Progress(steps, label) if rank == 0 else None
        result = train_ddp(row.config, steps=steps, on_step=bar.update if bar else None)
        out.append(
            {
                "label": row.label,
                "bytes_per_step": result.bytes_per_step,
                "step_seconds": result.step_seconds,
                "eval_loss": result.eval_loss,
            }
        )
    return out


def progress_labels(labels: list[str]) -> list[str]:
    """``[i/n] label`` for each row, padded to the longest so the progress bars line up."""
    width = max(map(len, labels), default=0)
    return [f"[{i}/{len(labels)}] {label:<{width}}" for i, label in enumerate(labels, start=1)]


def rows_from_specs(specs: list[str], steps: int) -> list[DemoRow]:
    """``["none", "powersgd:rank=2"]`` -> demo rows: a demo row's name is that row (for a run
    of ``steps``), anything else a method spec; each config validated (ConfigError naming
    ``--methods``)."""
    from commpress.config import Config

    named = {row.label: row for row in demo_rows(steps)}
    rows = []
    for spec in specs:
        if spec in named:
            rows.append(named[spec])
            continue
        try:
            config = parse_method_spec(spec)
            Config.load(config)
        except ConfigError as exc:
            raise ConfigError(f"--methods {spec!r}: {exc}") from None
        rows.append(DemoRow(spec, config))
    return rows


def never_compressed(rows: list[DemoRow], steps: int) -> dict[str, int]:
    """Label -> ``start_iter`` of every row whose compression starts at or after the last step."""
    return {row.label: row.config["start_iter"] for row in rows if row.config.get("start_iter", 0) >= steps}


def run(args: argparse.Namespace) -> int:
    from commpress.bench.launch import run_local
    from commpress.cli.ranks import check_output_path

    rows = rows_from_specs(args.methods, args.steps) if args.methods is not None else demo_rows(args.steps)
    if args.json is not None:
        check_output_path("--json", args.json)
    print(f"commpress demo: {args.ranks} ranks on gloo/CPU, {args.steps} steps per method", file=sys.stderr)
    results = run_local(_rank_main, args.ranks, rows, args.steps)[0]
    print(render(results, never_compressed(rows, args.steps), args.steps))
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)  # floats as repr: they read back bit for bit
            f.write("\n")
    return 0


def render(results: list[dict[str, Any]], uncompressed: dict[str, int] | None = None, steps: int = DEFAULT_STEPS) -> str:
    """The demo table; ratios and gaps are against the first row. ``uncompressed``: label ->
    start_iter of the rows that never compressed in a run of ``steps``, marked with ``*``
    and named under the table."""
    uncompressed = uncompressed or {}
    ref = results[0]
    table = []
    for r in results:
        ratio = ref["bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else float("inf")
        gap = 100 * (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        table.append(
            [
                r["label"],
                f"{r['bytes_per_step']:,.0f}",
                f"{ratio:.1f}x" + ("*" if r["label"] in uncompressed else ""),
                f"{1000 * r['step_seconds']:.1f}",
                f"{r['eval_loss']:.4f}",
                f"{gap:+.2f}%",
            ]
        )
    headers = ["method", "bytes/step/rank", "compression", "step ms", "final loss", f"gap vs {ref['label']}"]
    notes = [
        f"* {label}: start_iter = {start} is not below --steps {steps}: it never compressed (plain all-reduce "
        "throughout); give more steps or a smaller start_iter"
        for label, start in uncompressed.items()
    ]
    return "\n".join([format_table(headers, table), *notes])
