"""Where a benchmark command's ranks come from: N local processes (``--local N``) or the
ranks a launcher started (torchrun, mpirun)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from commpress.cmdline import integer

__all__ = ["add_rank_arguments", "run_and_report", "run_on_ranks"]


def add_rank_arguments(parser: argparse.ArgumentParser, plot: str) -> None:
    """The options every command run through :func:`run_and_report` shares: threads per
    launched rank, ``--json`` and ``--plot`` (``plot``: what the picture shows)."""
    parser.add_argument(
        "--threads",
        type=integer(1),
        help="torch threads per rank under torchrun/mpirun (default: cores / local ranks; --local splits the cores itself)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': standard output)")
    parser.add_argument("--plot", metavar="PNG", help=f"write {plot}")


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
    from commpress.errors import ConfigError

    launch = detect_launcher()
    if local is not None:
        from commpress.comm.launch import run_local

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
