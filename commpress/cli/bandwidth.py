"""Measure the links between ranks, plan per-group compression, and compare hierarchical
+ per-group compression with single global settings on the demo task.

Prints the measured topology (bandwidth, latency and burst of every link, the shared
uplinks, the fast domains) and each adaptive row's plan for the demo model with the
traffic predicted per group, then trains the demo model once per row (the same seed and
data) and prints step time, bytes each rank sends per step (across domains, for the
adaptive rows) and the held-out loss, and for each adaptive row every group's predicted
bytes and milliseconds per step next to the measured ones. Final losses count as equal
unless they differ by more than 1% and, with several seeds, by more than the seed-by-seed
spread of their difference. Launch it on real links with ``commpress linkemu``, with
``torchrun``, or with ``--local N`` on this machine. Example (two nodes of two ranks,
100 Mbit/s between them)::

    sudo python -m commpress linkemu --ranks 4 --nodes 2 --inter-rate 100mbit -- \\
        python -m commpress bandwidth --steps 200 --expect-domains 0,1/2,3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import TYPE_CHECKING, Any

from commpress.bench.arguments import LIST_HELP, integer, listed, method_list, number
from commpress.cmdline import parse_method_spec
from commpress.errors import ConfigError
from commpress.terminal import format_table

if TYPE_CHECKING:
    import torch

    from commpress.bandwidth.layer import AdaptiveLayer
    from commpress.bandwidth.planner import HierarchyPlan
    from commpress.bandwidth.timing import Measured, Record
    from commpress.bandwidth.topology import Topology
    from commpress.bandwidth.traffic import ModelLayout

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
#: Final losses closer than this fraction are not told apart. The demo task's loss moves by
#: up to 5% from seed to seed at 200 steps, and the difference between two settings by a
#: few percent (docs/bandwidth.md); with several seeds the spread of that difference also
#: counts.
LOSS_MARGIN = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--local", type=integer(1), metavar="N", help="start N ranks on this machine (default: from torchrun/linkemu)"
    )
    parser.add_argument("--steps", type=integer(1), default=200, help="training steps per row (default 200)")
    parser.add_argument(
        "--seeds",
        type=integer(1),
        default=1,
        help="train every row with seeds 0 .. N-1 of the demo task, report means (default 1)",
    )
    parser.add_argument(
        "--methods",
        type=method_list(allow_empty=True),
        help=f"global settings: {LIST_HELP} (default: the registered ones of a built-in list)",
    )
    parser.add_argument(
        "--adaptive",
        type=method_list(allow_empty=True),
        help=f"methods to run with [bandwidth] adaptive = true: {LIST_HELP}",
    )
    parser.add_argument(
        "--budgets",
        type=listed(number(0, low_open=False)),
        default=[0.0, 25.0],
        help="[bandwidth] budget_ms values separated by ',' or ';', one adaptive row each "
        "(0: even out with the fastest link; default 0,25)",
    )
    parser.add_argument(
        "--probe-ms", type=number(0, 10_000), default=40.0, help="duration of one bandwidth probe in ms (default 40)"
    )
    parser.add_argument(
        "--measure-only",
        action="store_true",
        help="print the measured topology and each adaptive row's plan (its predicted traffic), train nothing",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="also write the topology, the plans, the predicted and measured traffic and the rows"
    )
    parser.add_argument("--expect-domains", help="the domains that were built, e.g. 0,1/2,3: exit 1 if the measurement differs")
    parser.add_argument("--threads", type=integer(1), help="torch threads per rank (default: cores / local ranks)")


def _available(specs: tuple[str, ...]) -> list[str]:
    from commpress.compressors import available

    names = set(available())
    return [s for s in specs if s.partition(":")[0] in names]


def _rows(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(label, config) of every row, each config validated (ConfigError naming the option)."""
    globals_ = args.methods if args.methods is not None else _available(GLOBAL_ROWS)
    adaptive = args.adaptive if args.adaptive is not None else _available(ADAPTIVE_ROWS)[:2]
    rows = [(spec, _config("--methods", spec)) for spec in globals_]
    for spec in adaptive:
        for budget in args.budgets:
            table = {"adaptive": True, "probe_ms": args.probe_ms, "budget_ms": budget}
            rows.append((f"adaptive {spec}" + (f" {budget:g}ms" if budget else ""), _config("--adaptive", spec, table)))
    if not rows and not args.measure_only:
        raise ConfigError("--methods and --adaptive name no row to train; pass --measure-only to only measure the links")
    return rows


def _config(option: str, spec: str, bandwidth: dict[str, Any] | None = None) -> dict[str, Any]:
    from commpress.config import Config

    try:
        config = parse_method_spec(spec)
        if bandwidth is not None:
            config["bandwidth"] = bandwidth
        Config.load(config)
    except ConfigError as exc:
        raise ConfigError(f"{option} {spec!r}: {exc}") from None
    return config


def rank_main(rank: int, world: int, args: argparse.Namespace, rows: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """What every rank runs: measure, plan, train each row; rank 0's result is reported."""
    from commpress.bandwidth.measurement import measure_topology
    from commpress.bandwidth.timing import recording
    from commpress.comm.torch_backend import TorchLinks
    from commpress.workloads.charlm import CharTask
    from commpress.workloads.train import train_ddp

    topology = measure_topology(TorchLinks(), probe_ms=args.probe_ms)
    model = CharTask().model()
    out: dict[str, Any] = {"topology": topology.to_dict(), "domains": topology.domains, "plans": {}, "rows": []}
    report = sys.stdout if args.measure_only else sys.stderr  # the result, or what a run starts from
    if rank == 0:
        print(topology, "\n", file=report, flush=True)
    for label, config in rows:
        if "bandwidth" in config:
            plan = plan_for(topology, model, config)
            out["plans"][label] = {"plan": plan.to_dict(), "groups": group_rows(plan)}
            if rank == 0:
                head = f"plan for {label} on the demo model (predicted from the measured links):"
                print(f"{head}\n{plan}\n", file=report, flush=True)
    if args.measure_only:
        return out
    for i, (label, config) in enumerate(rows):
        runs = []
        for seed in range(args.seeds):
            if rank == 0:
                print(f"[{i + 1}/{len(rows)}] {label}, seed {seed}", file=sys.stderr, flush=True)
            with recording() as log:
                result = train_ddp(config, steps=args.steps, task=CharTask(batch_size=64, seed=seed))
            run = {"bytes_per_step": result.bytes_per_step, "step_seconds": result.step_seconds, "eval_loss": result.eval_loss}
            if log.layer is not None:
                run["groups"] = compare(log.layer, _gather_records(log.records))
                run.update(plan=log.layer.plan.to_dict(), topology=log.layer.topology.to_dict())
            runs.append(run)
        row = {"label": label, **runs[0], "seeds": runs}
        for key in ("bytes_per_step", "step_seconds", "eval_loss"):  # means over seeds
            row[key] = statistics.fmean(r[key] for r in runs)
        out["rows"].append(row)
    return out


def plan_for(topology: Topology, model: torch.nn.Module, config: dict[str, Any]) -> HierarchyPlan:
    """The plan an adaptive ``config`` makes for ``model`` over ``topology`` (DDP's default buckets)."""
    from commpress.bandwidth.planner import plan_hierarchy
    from commpress.bandwidth.traffic import ModelLayout, ddp_buckets
    from commpress.config import Config
    from commpress.config.groups import MethodGroups

    groups = MethodGroups(Config.load(config))
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
    layout = ModelLayout(ddp_buckets(named), {name: groups.key_for(name) for name, _ in named})
    return plan_hierarchy(topology, layout, groups.specs, groups.config.section("bandwidth"))


def group_rows(
    plan: HierarchyPlan,
    measured: list[Measured] | None = None,
    layout: ModelLayout | None = None,
    topology: Topology | None = None,
) -> list[dict[str, Any]]:
    """Per group: its method and the predicted bytes and seconds per step, with the
    measured ones where given (then predicted for ``layout``, the buckets that ran)."""
    from commpress.bandwidth.planner import describe
    from commpress.bandwidth.traffic import predict

    predicted = plan.predicted if layout is None else predict(topology, plan, layout, plan.methods)
    methods = [describe(m) for m in plan.methods] + ["none"] * len(plan.domains)
    out = []
    for i, (g, method) in enumerate(zip(predicted, methods, strict=True)):
        row = {"group": g.name, "ranks": list(g.ranks), "method": method, "predicted_bytes": g.payload_bytes}
        row["predicted_seconds"] = g.seconds
        if measured is not None:
            row.update(measured_bytes=measured[i].payload_bytes, measured_seconds=measured[i].seconds, steps=measured[i].steps)
        out.append(row)
    return out


def compare(layer: AdaptiveLayer, records: list[list[Record]]) -> list[dict[str, Any]]:
    """Every group of ``layer``'s last plan: predicted (for the buckets it ran) and measured."""
    from commpress.bandwidth.timing import measured

    return group_rows(layer.plan, measured(records, layer.plan), layer.observed_layout(), layer.topology)


def _gather_records(records: list[Record]) -> list[list[Record]]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, records)
    return out


def render_groups(label: str, groups: list[dict[str, Any]]) -> str:
    """One trained adaptive row's groups: predicted bytes and ms per step next to the measured ones."""
    table = []
    for g in groups:
        ratio = f"{g['measured_seconds'] / g['predicted_seconds']:.2f}" if g["predicted_seconds"] else "-"  # a rank alone
        table.append(
            [
                g["group"],
                " ".join(map(str, g["ranks"])),
                g["method"],
                f"{g['predicted_bytes']:,.0f}",
                f"{g['measured_bytes']:,.0f}",
                f"{1000 * g['predicted_seconds']:.2f}",
                f"{1000 * g['measured_seconds']:.2f}",
                ratio,
            ]
        )
    head = f"{label}: per group and step, predicted from the topology and measured"
    cols = ["group", "ranks", "method", "bytes pred", "bytes meas", "ms pred", "ms meas", "meas/pred"]
    return f"{head}\n{format_table(cols, table)}"


def loss_order(a: dict[str, Any], b: dict[str, Any]) -> int:
    """-1, 0 or 1: ``b``'s final loss measurably below ``a``'s, no measurable difference, or
    above. Measurable: the mean seed-by-seed difference exceeds :data:`LOSS_MARGIN` of
    ``a``'s loss and the spread (max - min) of those differences over the seeds."""
    diffs = [rb["eval_loss"] - ra["eval_loss"] for ra, rb in zip(a.get("seeds", [a]), b.get("seeds", [b]), strict=True)]
    mean = statistics.fmean(diffs)
    if abs(mean) <= max(LOSS_MARGIN * a["eval_loss"], max(diffs) - min(diffs)):
        return 0
    return 1 if mean > 0 else -1


def render(rows: list[dict[str, Any]]) -> str:
    """The comparison table, plus for each adaptive row the fastest global row whose final
    loss is lower or not measurably different (:func:`loss_order`)."""
    ref = rows[0]
    table = [
        [
            r["label"],
            f"{r['bytes_per_step']:,.0f}",
            f"{1000 * r['step_seconds']:.1f}",
            f"{r['eval_loss']:.4f}",
            _spread(r),
            f"{100 * (r['eval_loss'] - ref['eval_loss']) / ref['eval_loss']:+.2f}%",
        ]
        for r in rows
    ]
    seeds = len(rows[0].get("seeds", [None]))
    head = ["setting", "bytes/step/rank", "step ms", "final loss", f"min .. max ({seeds} seeds)", f"gap vs {ref['label']}"]
    flat = [r for r in rows if not r["label"].startswith("adaptive ")]
    adaptive = [r for r in rows if r["label"].startswith("adaptive ")]
    lines = [format_table(head, table)]
    if adaptive:
        lines.append("(adaptive rows: bytes sent across domains; inside a domain nothing is compressed)")
    if adaptive and flat:
        spread = ", beyond the seed-by-seed spread of their difference" if seeds > 1 else "; --seeds 3 weighs the seeds' spread"
        lines.append(f"(final losses differ measurably when more than {100 * LOSS_MARGIN:g}% apart{spread})")
    for a in adaptive if flat else ():
        order = {r["label"]: loss_order(a, r) for r in flat}
        if all(o > 0 for o in order.values()):
            lines.append(f"{a['label']}: measurably lower final loss than every global setting")
            continue
        best = min((r for r in flat if order[r["label"]] <= 0), key=lambda r: r["step_seconds"])
        loss = f"{best['label']}'s is measurably lower" if order[best["label"]] < 0 else "the difference is not measurable"
        lines.append(
            f"{a['label']}: {best['step_seconds'] / a['step_seconds']:.2f}x the speed of {best['label']}, the fastest "
            f"global setting whose final loss is not measurably higher ({loss})"
        )
    return "\n".join(lines)


def _spread(row: dict[str, Any]) -> str:
    """The final losses' range over the row's seeds."""
    losses = [r["eval_loss"] for r in row.get("seeds", [row])]
    return f"{min(losses):.4f} .. {max(losses):.4f}"


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

    rows = _rows(args)
    launch = detect_launcher()
    world = args.local if args.local is not None else launch.world_size if launch.kind != "none" else None
    expected = _domains(args.expect_domains, world) if args.expect_domains is not None else None
    if args.local is not None:
        from commpress.bench.launch import run_local

        result = run_local(rank_main, args.local, args, rows)[0]
    else:
        if launch.kind == "none":
            raise ConfigError("not started by torchrun, mpirun or linkemu; pass --local N")
        import torch
        import torch.distributed as dist

        from commpress.comm.from_env import init_from_env

        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // launch.local_world_size))
        init_from_env("gloo")
        try:
            result = rank_main(launch.rank, launch.world_size, args, rows)
        finally:
            dist.destroy_process_group()
        if launch.rank != 0:
            return 0
    if result["rows"]:  # with --measure-only, rank 0 printed the topology and the plans
        print(render(result["rows"]))
    for row in result["rows"]:
        if "groups" in row:
            print("\n" + render_groups(row["label"], row["groups"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "domains": [list(d) for d in result["domains"]]}, f, indent=1)
    if expected is not None:
        ok = tuple(result["domains"]) == expected
        verdict = "match" if ok else "DO NOT match"
        print(f"measured domains {list(map(list, result['domains']))} {verdict} the expected {list(map(list, expected))}")
        return 0 if ok else 1
    return 0
