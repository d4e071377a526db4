"""Compare plain FSDP with QSDP (quantized weights and gradients) on the demo task.

FSDP2 (``fully_shard``, one unit per layer) trains the demo model once per row, same seed
and data; the table shows the bytes each rank contributes per step to the parameter
all-gathers and to the gradient reduce-scatters, the compression against the first row,
the median step time, the held-out loss and its gap to the first row. Launch it with
``--local N`` (N ranks on this machine) or under ``torchrun`` (one process per rank; the
environment's RANK / WORLD_SIZE / MASTER_ADDR are used).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

from commpress.cli.progress import Progress
from commpress.cli.table import format_table
from commpress.errors import ConfigError

__all__ = ["FSDP_ROWS", "add_arguments", "parse_rows", "run"]

_OFF = {"weight_bits": 32, "grad_bits": 32}


@dataclass(frozen=True)
class Row:
    """One line of the table: a label and its ``[fsdp]`` settings."""

    label: str
    config: dict[str, Any]


#: Default rows; the first is the reference (plain FSDP collectives, counted).
FSDP_ROWS = [
    Row("fsdp", dict(_OFF)),
    Row("qsdp-w8g8", {"weight_bits": 8, "grad_bits": 8}),
    Row("qsdp-w4g8", {"weight_bits": 4, "grad_bits": 8}),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", type=int, metavar="N", help="start N ranks on this machine (default: torchrun's environment)")
    parser.add_argument("--steps", type=int, default=100, help="training steps per row (default 100)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden width of the demo model (default 512)")
    parser.add_argument("--batch", type=int, default=64, help="batch size per rank (default 64)")
    parser.add_argument(
        "--rows",
        help="semicolon-separated rows 'label' or 'label:key=value,...' with [fsdp] keys, "
        "e.g. 'fsdp;qsdp:weight_bits=8,grad_bits=8' (a bare 'fsdp' is plain FSDP; default: fsdp, w8g8, w4g8)",
    )
    parser.add_argument("--mesh", help="HSDP mesh 'R,S' (replicas x shards; default: 1-D over all ranks)")
    parser.add_argument(
        "--threads", type=int, help="torch threads per rank under a launcher (default: cores / LOCAL_WORLD_SIZE or WORLD_SIZE)"
    )


def parse_rows(text: str) -> list[Row]:
    """``"fsdp;q8:weight_bits=8,grad_bits=8"`` -> rows (ConfigError on bad keys/values)."""
    import tomllib

    from commpress.hooks.fsdp_config import parse

    rows = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        label, _, rest = spec.partition(":")
        config: dict[str, Any] = {} if rest or label.strip() != "fsdp" else dict(_OFF)
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, raw = item.partition("=")
            if not eq:
                raise ConfigError(f"--rows: {item!r} in {spec!r} is not key=value")
            try:
                config[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                config[key.strip()] = raw
        parse(config)  # validate now, not on every rank
        rows.append(Row(label.strip(), config))
    if not rows:
        raise ConfigError(f"--rows = {text!r} names no row")
    return rows


def _rank_main(rank: int, world: int, rows: list[Row], args: dict[str, Any]) -> list[dict[str, Any]]:
    from commpress.workloads.charlm import CharTask
    from commpress.workloads.train_fsdp import train_fsdp

    out = []
    for i, row in enumerate(rows):
        bar = Progress(args["steps"], f"[{i + 1}/{len(rows)}] {row.label:<12}") if rank == 0 and args["progress"] else None
        result = train_fsdp(
            row.config,
            steps=args["steps"],
            task=CharTask(batch_size=args["batch"]),
            hidden=args["hidden"],
            mesh_shape=args["mesh"],
            on_step=bar.update if bar else None,
        )
        out.append(
            {
                "label": row.label,
                "gather_bytes": result.traffic["all_gather"]["bytes_sent"],
                "scatter_bytes": result.traffic["reduce_scatter"]["bytes_sent"],
                "step_seconds": result.step_seconds,
                "eval_loss": result.eval_loss,
            }
        )
    return out


def render(results: list[dict[str, Any]]) -> str:
    """The table; compression and loss gap are against the first row."""
    ref = results[0]
    table = []
    for r in results:
        total = r["gather_bytes"] + r["scatter_bytes"]
        ratio = (ref["gather_bytes"] + ref["scatter_bytes"]) / total if total else float("inf")
        gap = 100 * (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        table.append(
            [
                r["label"],
                f"{r['gather_bytes']:,.0f}",
                f"{r['scatter_bytes']:,.0f}",
                f"{ratio:.2f}x",
                f"{1000 * r['step_seconds']:.1f}",
                f"{r['eval_loss']:.4f}",
                f"{gap:+.2f}%",
            ]
        )
    headers = ["method", "all-gather B/step/rank", "reduce-scatter B/step/rank", "compression", "step ms", "final loss"]
    return format_table([*headers, f"gap vs {ref['label']}"], table)


def _mesh(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        r, s = (int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"--mesh = {text!r} is not accepted; expected 'R,S' (replicas, shards)") from None
    return r, s


def run(args: argparse.Namespace) -> int:
    rows = parse_rows(args.rows) if args.rows else FSDP_ROWS
    if args.steps < 6:
        raise ConfigError(f"--steps = {args.steps} is not accepted; expected an integer >= 6")
    settings = {"steps": args.steps, "hidden": args.hidden, "batch": args.batch, "mesh": _mesh(args.mesh), "progress": True}
    if args.local:
        from commpress.comm.launch import run_local

        print(f"commpress bench-fsdp: {args.local} local ranks (gloo), {args.steps} steps per row", file=sys.stderr)
        results = run_local(_rank_main, args.local, rows, settings)[0]
    else:
        import torch.distributed as dist

        if "RANK" not in os.environ:
            raise ConfigError("bench-fsdp needs --local N or a launcher's environment (torchrun sets RANK, WORLD_SIZE)")
        import torch

        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local))
        dist.init_process_group("gloo")
        try:
            results = _rank_main(dist.get_rank(), dist.get_world_size(), rows, settings)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    print(render(results))
    return 0
