"""Measure step time, bytes and compression of every method side by side on your network.

Launch it with ``torchrun --nproc_per_node N``, ``mpirun -n N`` (detected from the
environment) or ``--local N`` (starts N ranks on this machine). Every method runs on the
same model and data in one run, next to the baselines ``ddp`` (plain all-reduce),
``torch-fp16`` and ``torch-powersgd`` (PyTorch's own hooks). Methods: ``--methods``
and/or ``--config file.toml``. Rank 0 prints the table; ``--json`` and ``--plot`` save
it. Example::

    commpress bench --local 2 --scale 0.05 --methods "ddp,torch-powersgd:rank=4,powersgd:rank=4,topk"
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import TYPE_CHECKING

from commpress.bench.catalog import WORKLOADS
from commpress.cli.ranks import add_rank_arguments
from commpress.cmdline import LIST_HELP, integer, method_list, number
from commpress.errors import ConfigError

if TYPE_CHECKING:
    from commpress.bench.methods import BenchMethod
    from commpress.bench.runner import BenchPlan

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--local", type=integer(1), metavar="N", help="start N ranks on this machine (gloo) instead of a launcher"
    )
    parser.add_argument(
        "--methods",
        type=method_list(),
        help=f"{LIST_HELP}: the baselines ddp, torch-fp16, torch-powersgd or commpress methods, "
        "e.g. 'ddp;torch-powersgd:rank=4;powersgd:rank=4' (default: the baselines and every commpress method with "
        "default parameters)",
    )
    parser.add_argument(
        "--config", action="append", default=[], metavar="FILE", help="a commpress config file as one more row (repeatable)"
    )
    parser.add_argument("--workload", default="gpt2", choices=WORKLOADS, help="gradient shapes to send (default gpt2)")
    parser.add_argument(
        "--scale",
        type=number(0, 1),
        default=0.1,
        help="fraction of the model's parameters, in (0, 1] (default 0.1; 1 = real size)",
    )
    parser.add_argument("--batch", type=integer(1), default=8, help="rank of the shaped gradients / demo batch size (default 8)")
    parser.add_argument("--steps", type=integer(1), default=20, help="timed steps per method (default 20)")
    parser.add_argument("--warmup", type=integer(2), default=5, help="untimed steps first (default 5, at least 2)")
    parser.add_argument("--bucket-cap-mb", type=number(0), help="DDP bucket size (default DDP's 25)")
    add_rank_arguments(parser, plot="a bar chart of step time per method")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="build every row's model first, then run each step on every row in turn (for a machine whose speed drifts; "
        "needs memory for all models at once)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    """Validate the command line into a plan (ConfigError on bad values)."""
    from commpress.bench.methods import default_methods, method_from_config, parse_methods
    from commpress.bench.runner import BenchPlan
    from commpress.bench.workloads import make_workload

    methods = [] if args.methods is None and args.config else None
    if args.methods is not None:
        methods = parse_methods(args.methods)
    if methods is None:
        methods = default_methods()
    for path in args.config:
        try:
            methods.append(method_from_config(path))
        except ConfigError as exc:
            raise ConfigError(f"--config: {exc}") from None
    late = [(m.label, _start_iter(m)) for m in methods if _start_iter(m) > args.warmup]
    if late:
        raise ConfigError(
            f"--warmup = {args.warmup} is not accepted: {late[0][0]} starts compressing at step {late[0][1]}; "
            "warm up at least that long"
        )
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and path != "-":
            check_output_path(option, path)
    if args.plot is not None:
        check_can_plot()
    make_workload(args.workload, args.scale, args.batch)
    return BenchPlan(
        methods=tuple(methods),
        workload=args.workload,
        scale=args.scale,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        bucket_cap_mb=args.bucket_cap_mb,
        progress=not args.quiet,
        interleave=args.interleave,
    )


def check_output_path(option: str, path: str) -> None:
    """ConfigError unless ``path`` can be written: found now, not after the whole run."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"{option} = {path!r} is not accepted; expected a file path in an existing, writable folder")


def check_can_plot() -> None:
    """ConfigError unless matplotlib (the bench extra) is installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib (commpress's bench extra)")


def _start_iter(method: BenchMethod) -> int:
    if method.kind == "torch-powersgd":
        return method.params["start_iter"]
    return method.config.start_iter if method.config is not None else 0


def run(args: argparse.Namespace) -> int:
    from commpress.bench import report
    from commpress.bench.runner import bench_rank
    from commpress.cli.ranks import run_and_report

    plan = plan_from_args(args)
    return run_and_report(bench_rank, plan, args, "bench", functools.partial(_banner, plan), report)


def _banner(plan: BenchPlan, world: int, how: str) -> None:
    print(
        f"commpress bench: {len(plan.methods)} methods, {world} ranks ({how}), workload {plan.workload}",
        file=sys.stderr,
    )
