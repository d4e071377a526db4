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
import sys
from typing import TYPE_CHECKING

from commpress.bench.arguments import integer, number
from commpress.bench.catalog import WORKLOADS
from commpress.cli.ranks import add_method_arguments, add_rank_arguments, check_outputs, methods_from_args
from commpress.errors import ConfigError

if TYPE_CHECKING:
    from commpress.bench.methods import BenchMethod
    from commpress.bench.runner import BenchPlan

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_method_arguments(parser, "(default: the baselines and every commpress method with default parameters)")
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
    from commpress.bench.methods import default_methods
    from commpress.bench.runner import BenchPlan
    from commpress.bench.workloads import make_workload

    methods = methods_from_args(args, default_methods)
    late = [(m.label, _start_iter(m)) for m in methods if _start_iter(m) > args.warmup]
    if late:
        raise ConfigError(
            f"--warmup = {args.warmup} is not accepted: {late[0][0]} starts compressing at step {late[0][1]}; "
            "warm up at least that long"
        )
    check_outputs(args)
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
