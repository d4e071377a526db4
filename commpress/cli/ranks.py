"""What the commands that run methods side by side on ranks (bench, race) share: where the
ranks come from (N local processes, ``--local N``, or the ranks a launcher started:
torchrun, mpirun), the options that name the rows and the outputs, and rank 0's report."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from commpress.bench.arguments import LIST_HELP, integer, method_list, number
from commpress.errors import ConfigError

if TYPE_CHECKING:
    from commpress.bench.methods import BenchMethod

__all__ = [
    "add_method_arguments",
    "add_rank_arguments",
    "check_output_path",
    "check_outputs",
    "methods_from_args",
    "run_and_report",
    "run_on_ranks",
]


def add_method_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """The options that open the command line: ``--local``, then the rows, ``--methods``
    (``default``: its help's last words, on what runs without it) and ``--config``."""
    parser.add_argument(
        "--local", type=integer(1), metavar="N", help="start N ranks on this machine (gloo) instead of a launcher"
    )
    parser.add_argument(
        "--methods",
        type=method_list(),
        help=f"{LIST_HELP}: the baselines ddp, torch-fp16, torch-powersgd or commpress methods, "
        f"e.g. 'ddp;torch-powersgd:rank=4;powersgd:rank=4' {default}",
    )
    parser.add_argument(
        "--config", action="append", default=[], metavar="FILE", help="a commpress config file as one more row (repeatable)"
    )


def add_rank_arguments(parser: argparse.ArgumentParser, plot: str, bucket: str = "") -> None:
    """The options after a command's own: the DDP bucket size (``bucket``: what else the help
    says of its default), threads per launched rank, ``--json`` and ``--plot`` (``plot``:
    what the picture shows), the last three read by :func:`run_and_report`."""
    parser.add_argument("--bucket-cap-mb", type=number(0), help=f"DDP bucket size (default DDP's 25{bucket})")
    parser.add_argument(
        "--threads",
        type=integer(1),
        help="torch threads per rank under torchrun/mpirun (default: cores / local ranks; --local splits the cores itself)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': standard output)")
    parser.add_argument("--plot", metavar="PNG", help=f"write {plot}")


def methods_from_args(args: argparse.Namespace, default: Callable[[], list[BenchMethod]]) -> list[BenchMethod]:
    """The rows ``--methods`` names, then one per ``--config`` file; ``default()`` when
    neither is given (ConfigError on bad values)."""
    from commpress.bench.methods import method_from_config, parse_methods

    if args.methods is not None:
        methods = parse_methods(args.methods)
    elif args.config:
        methods = []
    else:
        methods = default()
    for path in args.config:
        try:
            methods.append(method_from_config(path))
        except ConfigError as exc:
            raise ConfigError(f"--config: {exc}") from None
    return methods


def check_outputs(args: argparse.Namespace) -> None:
    """ConfigError unless ``--json`` and ``--plot`` can be written, before any rank starts."""
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and path != "-":
            check_output_path(option, path)
    if args.plot is not None:
        _check_can_plot()


def check_output_path(option: str, path: str) -> None:
    """ConfigError unless ``path`` can be written: found now, not after the whole run."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"{option} = {path!r} is not accepted; expected a file path in an existing, writable folder")


def _check_can_plot() -> None:
    """ConfigError unless matplotlib (the bench extra) is installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib (commpress's bench extra)")


def run_on_ranks(
    fn: Callable[[int, int, Any], Any],
    plan: Any,
    local: int | None,
    threads: int | None,
    command: str,
    banner: Callable[[int, str], None],
    timeout: float = 600.0,
) -> Any | None:
    """``fn(rank, world_size, plan)`` on every rank; rank 0's result (None on the others).

    ``local``: start that many gloo processes here; else join the launcher's ranks with
    ``threads`` torch threads each (default: the cores shared among the local ranks).
    ``banner(world_size, how)`` is printed once, by rank 0."""
    from commpress.comm.from_env import detect_launcher

    launch = detect_launcher()
    if local is not None:
        from commpress.bench.launch import run_local

        banner(local, "local processes")
        return run_local(fn, local, plan, timeout=timeout)[0]
    if launch.kind == "none":
        raise ConfigError(
            "not started by torchrun or mpirun; pass --local N to start N ranks here, or launch with "
            f"`torchrun --nproc_per_node N -m commpress {command} ...` / `mpirun -n N python -m commpress {command} ...`"
        )
    import torch
    import torch.distributed as dist

    from commpress.comm.from_env import init_from_env

    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // launch.local_world_size))
    init_from_env("gloo")
    if launch.rank == 0:
        banner(launch.world_size, launch.kind)
    try:
        raw = fn(launch.rank, launch.world_size, plan)
    finally:
        dist.destroy_process_group()
    return raw if launch.rank == 0 else None


def run_and_report(
    fn: Callable[[int, int, Any], Any],
    plan: Any,
    args: argparse.Namespace,
    command: str,
    banner: Callable[[int, str], None],
    report: ModuleType,
    timeout: float = 600.0,
) -> int:
    """:func:`run_on_ranks` with ``args.local`` and ``args.threads``; rank 0 prints
    ``report``'s table of the result and writes ``args.json`` and ``args.plot`` (``report``:
    a module with ``summarize``, ``format_report``, ``write_json`` and ``write_plot``)."""
    raw = run_on_ranks(fn, plan, args.local, args.threads, command, banner, timeout)
    if raw is None:
        return 0
    summary = report.summarize(raw)
    print(report.format_report(summary))
    if args.json:
        report.write_json(summary, args.json)
    if args.plot:
        report.write_plot(summary, args.plot)
    return 0
