"""Train the demo model on N local ranks with each compressor and compare them.

Next-character prediction on Python's own standard-library sources (no downloads), DDP
on gloo (CPU), the same seed and data for every method. The table shows bytes each rank
sends per step, the compression ratio against ``none``, the median step time, the
held-out loss at the end and its gap to ``none``. ``--json`` also writes every row with its
loss at full precision.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from commpress.cli.args import integer
from commpress.cli.bench import check_output_path
from commpress.config import Config, parse_method_spec
from commpress.errors import ConfigError
from commpress.terminal import Progress, format_table

__all__ = ["DEMO_ROWS", "DemoRow", "add_arguments", "progress_labels", "run"]


@dataclass(frozen=True)
class DemoRow:
    """One line of the demo table: a label and the commpress config it trains with."""

    label: str
    config: dict[str, Any]


#: The methods the demo compares, in table order; the first row is the reference.
DEMO_ROWS: list[DemoRow] = [
    DemoRow("none", {"method": "none"}),
    DemoRow("fp16", {"method": "fp16"}),
    DemoRow("bf16", {"method": "bf16"}),
    # the low-rank rows start after 20 plain steps, 10% of the default run, as PyTorch
    # recommends for its PowerSGD hook (start_powerSGD_iter): early gradients change too fast
    DemoRow("powersgd", {"method": "powersgd", "start_iter": 20, "params": {"rank": 4}}),
    DemoRow("acpsgd", {"method": "acpsgd", "start_iter": 20, "params": {"rank": 4}}),
    DemoRow("terngrad", {"method": "terngrad"}),
    DemoRow("topk", {"method": "topk", "params": {"ratio": 0.01}}),
    DemoRow("local-sgd+qsr", {"method": "none", "local_sgd": {"period": 4, "qsr_alpha": 0.2}}),
    DemoRow("co2", {"method": "bf16", "local_sgd": {"algorithm": "co2", "period": 5, "outer_lr": 0.7}}),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=integer(1), default=2, help="local ranks to start (default 2)")
    parser.add_argument("--steps", type=integer(1), default=200, help="training steps per method (default 200)")
    parser.add_argument(
        "--methods",
        default=None,
        help="semicolon-separated method specs, e.g. 'none;powersgd:rank=2' (default: every demo row)",
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


def rows_from_specs(text: str) -> list[DemoRow]:
    """``"none;powersgd:rank=2"`` -> demo rows, each config validated (ConfigError naming ``--methods``)."""
    rows = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        try:
            config = parse_method_spec(spec)
            Config.load(config)
        except ConfigError as exc:
            raise ConfigError(f"--methods {spec!r}: {exc}") from None
        rows.append(DemoRow(spec, config))
    if not rows:
        raise ConfigError(f"--methods = {text!r} names no method")
    return rows


def run(args: argparse.Namespace) -> int:
    from commpress.comm.launch import run_local

    rows = rows_from_specs(args.methods) if args.methods is not None else DEMO_ROWS
    if args.json is not None:
        check_output_path("--json", args.json)
    print(f"commpress demo: {args.ranks} ranks on gloo/CPU, {args.steps} steps per method", file=sys.stderr)
    results = run_local(_rank_main, args.ranks, rows, args.steps)[0]
    print(render(results))
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)  # floats as repr: they read back bit for bit
            f.write("\n")
    return 0


def render(results: list[dict[str, Any]]) -> str:
    """The demo table; ratios and gaps are against the first row."""
    ref = results[0]
    table = []
    for r in results:
        ratio = ref["bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else float("inf")
        gap = 100 * (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        table.append(
            [
                r["label"],
                f"{r['bytes_per_step']:,.0f}",
                f"{ratio:.1f}x",
                f"{1000 * r['step_seconds']:.1f}",
                f"{r['eval_loss']:.4f}",
                f"{gap:+.2f}%",
            ]
        )
    headers = ["method", "bytes/step/rank", "compression", "step ms", "final loss", f"gap vs {ref['label']}"]
    return format_table(headers, table)
