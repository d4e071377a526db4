"""Compare plain FSDP, FSDP2's own bf16 mixed precision and QSDP (quantized weights and
gradients) on the demo task.

FSDP2 (``fully_shard``, one unit per layer) trains the demo model once per row, same seed
and data. The ``fsdp-bf16`` row is the baseline FSDP2 offers itself:
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)`` gathers weights and
reduces gradients in bf16 (half the bytes) and computes in bf16. The table shows the
bytes each rank contributes per step to the parameter all-gathers and to the gradient
reduce-scatters, the compression against the first row, the median step time, the
held-out loss and its gap to the first row. Launch it with ``--local N`` (N ranks on this
machine) or under ``torchrun`` (one process per rank; the environment's RANK /
WORLD_SIZE / MASTER_ADDR are used).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from commpress.bench.arguments import LIST_HELP, integer, method_list, split_method_list
from commpress.bench.progress import Progress
from commpress.cli.demo import progress_labels
from commpress.cmdline import parse_settings
from commpress.errors import ConfigError
from commpress.terminal import format_table

__all__ = ["FSDP_ROWS", "MIXED_PRECISION", "Row", "add_arguments", "parse_rows", "run"]

_OFF = {"weight_bits": 32, "grad_bits": 32}
#: Values of a row's ``mixed_precision`` key: FSDP2's MixedPrecisionPolicy with this
#: param_dtype and reduce_dtype (names of torch dtypes).
MIXED_PRECISION = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Row:
    """One line of the table: a label, its ``[fsdp]`` settings and FSDP2's own mixed
    precision (a :data:`MIXED_PRECISION` key, or None for full precision)."""

    label: str
    config: dict[str, Any]
    mixed_precision: str | None = None


#: Default rows; the first is the reference (plain FSDP collectives, counted; the bf16 row's
#: collectives are counted the same way, in bf16).
FSDP_ROWS = [
    Row("fsdp", dict(_OFF)),
    Row("fsdp-bf16", dict(_OFF), "bf16"),
    Row("qsdp-w8g8", {"weight_bits": 8, "grad_bits": 8}),
    Row("qsdp-w4g8", {"weight_bits": 4, "grad_bits": 8}),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--local", type=integer(1), metavar="N", help="start N ranks on this machine (default: torchrun's environment)"
    )
    parser.add_argument("--steps", type=integer(6), default=100, help="training steps per row (default 100, at least 6)")
    parser.add_argument("--hidden", type=integer(1), default=512, help="hidden width of the demo model (default 512)")
    parser.add_argument("--batch", type=integer(1), default=64, help="batch size per rank (default 64)")
    parser.add_argument(
        "--rows",
        type=method_list(),
        help=f"rows as {LIST_HELP}: a new row is a label with [fsdp] keys and mixed_precision (bf16 or fp16: "
        "FSDP2's MixedPrecisionPolicy), e.g. 'fsdp;q4:weight_bits=4,grad_bits=8'; a name alone is a default row: "
        "fsdp (plain FSDP), fsdp-bf16 (FSDP2 in bf16), qsdp-w8g8, qsdp-w4g8 (default: all four)",
    )
    parser.add_argument("--mesh", help="HSDP mesh 'R,S' (replicas x shards; default: 1-D over all ranks)")
    parser.add_argument(
        "--threads",
        type=integer(1),
        help="torch threads per rank under a launcher (default: cores / LOCAL_WORLD_SIZE or WORLD_SIZE)",
    )


def parse_rows(rows_text: str | Sequence[str]) -> list[Row]:
    """A row list (``"fsdp;q8:weight_bits=8,grad_bits=8"``, the shared method-list grammar)
    or its specs -> rows (ConfigError on bad keys/values)."""
    from commpress.config.tables import TABLES

    text = rows_text if isinstance(rows_text, str) else ";".join(rows_text)
    try:
        specs = split_method_list(text)
    except ConfigError as exc:
        raise ConfigError(f"--rows {text!r}: {exc}") from None
    named = {row.label: row for row in FSDP_ROWS}
    rows = []
    for spec in specs:
        label, colon, rest = (part.strip() for part in spec.partition(":"))
        if not colon:  # a bare name is a default row; a new row needs its settings
            if label not in named:
                raise ConfigError(f"--rows: {label!r} is no default row ({', '.join(named)}); a new row is 'label:key=value,...'")
            rows.append(named[label])
            continue
        config: dict[str, Any] = {}
        mixed = None
        for key, value in parse_settings(rest, f"--rows {spec!r}"):
            if key == "mixed_precision":
                if not isinstance(value, str) or value not in MIXED_PRECISION:
                    raise ConfigError(
                        f"--rows: mixed_precision = {value!r} in {spec!r} is not accepted; accepted: {', '.join(MIXED_PRECISION)}"
                    )
                mixed = value
            else:
                config[key] = value
        try:
            TABLES["fsdp"](config)  # validate now, not on every rank
        except ConfigError as exc:
            raise ConfigError(f"--rows {spec!r}: {exc}") from None
        rows.append(Row(label, config, mixed))
    if not rows:
        raise ConfigError(f"--rows = {text!r} names no row")
    labels = [r.label for r in rows]
    twice = next((label for i, label in enumerate(labels) if label in labels[:i]), None)
    if twice is not None:
        raise ConfigError(f"--rows = {text!r} names the row {twice!r} twice")
    return rows


def _rank_main(rank: int, world: int, rows: list[Row], args: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    from commpress.workloads.charlm import CharTask
    from commpress.workloads.train_fsdp import train_fsdp

    out = []
    for row, label in zip(rows, progress_labels([row.label for row in rows])):
        bar = Progress(args["steps"], label) if rank == 0 and args["progress"] else None
        mixed = getattr(torch, MIXED_PRECISION[row.mixed_precision]) if row.mixed_precision else None
        result = train_fsdp(
            row.config,
            steps=args["steps"],
            task=CharTask(batch_size=args["batch"]),
            hidden=args["hidden"],
            mesh_shape=args["mesh"],
            mixed_precision=mixed,
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


def _mesh(text: str | None, world: int | None) -> tuple[int, int] | None:
    """The HSDP mesh of ``--mesh`` (its product must be ``world``, when known)."""
    if text is None:
        return None
    try:
        r, s = (int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"--mesh = {text!r} is not accepted; expected 'R,S' (replicas, shards)") from None
    if r < 1 or s < 1 or (world is not None and r * s != world):
        ranks = f" with R x S = {world} ranks" if world is not None else ""
        raise ConfigError(f"--mesh = {text!r} is not accepted; expected 'R,S' (replicas, shards), both >= 1{ranks}")
    return r, s


def run(args: argparse.Namespace) -> int:
    rows = parse_rows(args.rows) if args.rows is not None else FSDP_ROWS
    if args.local is None and "RANK" not in os.environ:
        raise ConfigError("needs --local N or a launcher's environment (torchrun sets RANK, WORLD_SIZE)")
    world = args.local if args.local is not None else _env_int("WORLD_SIZE")
    mesh = _mesh(args.mesh, world)
    settings = {"steps": args.steps, "hidden": args.hidden, "batch": args.batch, "mesh": mesh, "progress": True}
    if args.local is not None:
        from commpress.bench.launch import run_local

        print(f"commpress bench-fsdp: {args.local} local ranks (gloo), {args.steps} steps per row", file=sys.stderr)
        results = run_local(_rank_main, args.local, rows, settings)[0]
    else:
        import torch
        import torch.distributed as dist

        local = _env_int("LOCAL_WORLD_SIZE") or world or 1
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


def _env_int(name: str) -> int | None:
    """An integer from the launcher's environment (None when unset)."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name} = {text!r} is not accepted; expected an integer") from None
