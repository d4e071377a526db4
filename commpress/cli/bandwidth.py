"""Measure the links between ranks, plan per-link compression, and compare hierarchical
+ per-link compression with single global settings on the demo task.

Prints the measured topology (bandwidth and latency of every link, the fast domains), the
plan for the demo model, then trains the demo model once per row (the same seed and data)
and prints step time, bytes each rank sends per step (across domains, for the adaptive
rows), and the held-out loss. Launch it on real links with ``commpress linkemu``, with
``torchrun``, or with ``--local N`` on this machine. Example (two nodes of two ranks,
100 Mbit/s between them)::

    sudo python -m commpress linkemu --ranks 4 --nodes 2 --inter-rate 100mbit -- \\
        python -m commpress bandwidth --steps 200 --expect-domains 0,1/2,3
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from commpress.cli.args import integer, number
from commpress.config import Config, parse_method_spec
from commpress.errors import ConfigError
from commpress.terminal import format_table

__all__ = ["add_arguments", "run"]

#: Global settings compared by default (those whose method is registered).
GLOBAL_ROWS = (
    "none",
    "fp16",
    "powersgd:rank=1",
    "powersgd:rank=2",
    "powersgd:rank=4",
    "acpsgd:rank=4",
    "topk:ratio=0.01",
    "topk:ratio=0.03",
    "topk:ratio=0.1",
    "terngrad",
)
#: Methods run with ``[bandwidth] adaptive = true`` by default (the first two registered);
#: the plan sets their knob.
ADAPTIVE_ROWS = ("powersgd", "topk", "fp16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--local", type=integer(1), metavar="N", help="start N ranks on this machine (default: from torchrun/linkemu)"
    )
    parser.add_argument("--steps", type=integer(1), default=200, help="training steps per row (default 200)")
    parser.add_argument("--methods", help="semicolon-separated global settings (default: the registered ones of a built-in list)")
    parser.add_argument("--adaptive", help="semicolon-separated methods to run with [bandwidth] adaptive = true")
    parser.add_argument(
        "--budgets",
        default="0,25",
        help="comma-separated [bandwidth] budget_ms values, one adaptive row each "
        "(0: even out with the fastest link; default 0,25)",
    )
    parser.add_argument(
        "--probe-ms", type=number(0, 10_000), default=40.0, help="duration of one bandwidth probe in ms (default 40)"
    )
    parser.add_argument("--measure-only", action="store_true", help="print the topology and the plan, train nothing")
    parser.add_argument("--expect-domains", help="the domains that were built, e.g. 0,1/2,3: exit 1 if the measurement differs")
    parser.add_argument("--threads", type=integer(1), help="torch threads per rank (default: cores / local ranks)")


def _available(specs: tuple[str, ...]) -> list[str]:
    from commpress.compressors import available

    names = set(available())
    return [s for s in specs if s.partition(":")[0] in names]


def _rows(args: argparse.Namespace, budgets: list[float]) -> list[tuple[str, dict[str, Any]]]:
    """(label, config) of every row, each config validated (ConfigError naming the option)."""
    globals_ = args.methods.split(";") if args.methods is not None else _available(GLOBAL_ROWS)
    adaptive = args.adaptive.split(";") if args.adaptive is not None else _available(ADAPTIVE_ROWS)[:2]
    rows = [(spec, _config("--methods", spec)) for spec in filter(None, (s.strip() for s in globals_))]
    for spec in filter(None, (s.strip() for s in adaptive)):
        for budget in budgets:
            table = {"adaptive": True, "probe_ms": args.probe_ms, "budget_ms": budget}
            rows.append((f"adaptive {spec}" + (f" {budget:g}ms" if budget else ""), _config("--adaptive", spec, table)))
    if not rows and not args.measure_only:
        raise ConfigError("--methods and --adaptive name no row to train; pass --measure-only to only measure the links")
    return rows


def _config(option: str, spec: str, bandwidth: dict[str, Any] | None = None) -> dict[str, Any]:
    try:
        config = parse_method_spec(spec)
        if bandwidth is not None:
            config["bandwidth"] = bandwidth
        Config.load(config)
    except ConfigError as exc:
        raise ConfigError(f"{option} {spec!r}: {exc}") from None
    return config


def _budgets(text: str) -> list[float]:
    """``--budgets "0,25"`` -> [0.0, 25.0] (each a valid [bandwidth] budget_ms)."""
    from commpress.config.tables import BandwidthConfig

    budgets = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            budgets.append(BandwidthConfig(budget_ms=float(item)).budget_ms)
        except ValueError:  # float() or the table's range check
            raise ConfigError(f"--budgets = {text!r} is not accepted; expected comma-separated finite numbers >= 0") from None
    if not budgets:
        raise ConfigError(f"--budgets = {text!r} is not accepted; expected at least one number >= 0")
    return budgets


def rank_main(
    rank: int, world: int, args: argparse.Namespace, rows: list[tuple[str, dict[str, Any]]], budgets: list[float]
) -> dict[str, Any]:
    """What every rank runs: measure, plan, train each row; rank 0's result is reported."""
    from commpress.adaptive.planner import BandwidthConfig, plan_hierarchy
    from commpress.adaptive.topology import measure_topology
    from commpress.workloads.charlm import CharTask
    from commpress.workloads.train import train_ddp

    topology = measure_topology(probe_ms=args.probe_ms)
    model = CharTask().model()
    payload = sum(p.numel() * p.element_size() for p in model.parameters())
    out: dict[str, Any] = {"topology": str(topology), "domains": topology.domains, "rows": []}
    if rank == 0:
        print(out["topology"], "\n", file=sys.stderr)
        for budget in budgets:
            plan = plan_hierarchy(
                topology.domains, topology.bandwidth, payload, topology.latency, BandwidthConfig(budget_ms=budget)
            )
            print(f"plan for the demo model ({payload:,} bytes/step), budget_ms = {budget:g}:\n{plan}\n", file=sys.stderr)
    if args.measure_only:
        return out
    for i, (label, config) in enumerate(rows):
        if rank == 0:
            print(f"[{i + 1}/{len(rows)}] {label}", file=sys.stderr, flush=True)
        result = train_ddp(config, steps=args.steps)
        out["rows"].append(
            {
                "label": label,
                "bytes_per_step": result.bytes_per_step,
                "step_seconds": result.step_seconds,
                "eval_loss": result.eval_loss,
            }
        )
    return out


def render(rows: list[dict[str, Any]]) -> str:
    """The comparison table, plus the best global row and how the adaptive rows compare."""
    ref = rows[0]
    table = [
        [
            r["label"],
            f"{r['bytes_per_step']:,.0f}",
            f"{1000 * r['step_seconds']:.1f}",
            f"{r['eval_loss']:.4f}",
            f"{100 * (r['eval_loss'] - ref['eval_loss']) / ref['eval_loss']:+.2f}%",
        ]
        for r in rows
    ]
    text = format_table(["setting", "bytes/step/rank", "step ms", "final loss", f"gap vs {ref['label']}"], table)
    flat = [r for r in rows if not r["label"].startswith("adaptive ")]
    lines = [text, "(adaptive rows: bytes sent across domains; inside a domain nothing is compressed)"]
    for a in (r for r in rows if r["label"].startswith("adaptive ")):
        rivals = [r for r in flat if r["eval_loss"] <= a["eval_loss"]]
        if not rivals:
            lines.append(f"{a['label']}: lower final loss than every global setting")
            continue
        best = min(rivals, key=lambda r: r["step_seconds"])
        lines.append(
            f"{a['label']}: {best['step_seconds'] / a['step_seconds']:.2f}x the speed of the fastest global setting "
            f"with equal or lower loss ({best['label']})"
        )
    return "\n".join(lines)


def _domains(text: str, world: int | None) -> tuple[tuple[int, ...], ...]:
    """``--expect-domains "0,1/2,3"`` -> ((0, 1), (2, 3)): every rank once (all ``world``, when known)."""
    try:
        domains = tuple(sorted(tuple(sorted(int(r) for r in d.split(","))) for d in text.split("/") if d.strip()))
    except ValueError:
        domains = ()
    ranks = sorted(r for d in domains for r in d)
    if not domains or ranks != list(range(len(ranks))) or (world is not None and len(ranks) != world):
        of = f", all {world} ranks" if world is not None else ""
        raise ConfigError(f"--expect-domains = {text!r} is not accepted; expected ranks like 0,1/2,3, each rank once{of}")
    return domains


def run(args: argparse.Namespace) -> int:
    from commpress.comm.from_env import detect_launcher

    budgets = _budgets(args.budgets)
    rows = _rows(args, budgets)
    launch = detect_launcher()
    world = args.local if args.local is not None else launch.world_size if launch.kind != "none" else None
    expected = _domains(args.expect_domains, world) if args.expect_domains is not None else None
    if args.local is not None:
        from commpress.comm.launch import run_local

        result = run_local(rank_main, args.local, args, rows, budgets)[0]
    else:
        if launch.kind == "none":
            raise ConfigError("not started by torchrun, mpirun or linkemu; pass --local N")
        import torch
        import torch.distributed as dist

        from commpress.comm.from_env import init_from_env

        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // launch.local_world_size))
        init_from_env("gloo")
        try:
            result = rank_main(launch.rank, launch.world_size, args, rows, budgets)
        finally:
            dist.destroy_process_group()
        if launch.rank != 0:
            return 0
    if result["rows"]:
        print(render(result["rows"]))
    if expected is not None:
        ok = tuple(result["domains"]) == expected
        verdict = "match" if ok else "DO NOT match"
        print(f"measured domains {list(map(list, result['domains']))} {verdict} the expected {list(map(list, expected))}")
        return 0 if ok else 1
    return 0
