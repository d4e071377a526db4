"""Compare the training quality of every method on small tasks, in one process.

Trains each task (the demo's character MLP, a conv net on generated images, a tiny
transformer, a small ResNet with BatchNorm) with each optimizer (SGD with momentum 0.9, AdamW) and each method on 2
ranks simulated in this process, for several seeds, and prints the held-out loss at the
end and its gap to ``none`` on the same seed (mean, and min .. max over seeds). A method
that cannot run with an optimizer (Top-k with DGC needs SGD) is shown as n/a with the
reason. Example of a quick run::

    commpress quality --tasks charlm --optimizers sgd --methods "topk;topk-dgc" --seeds 1 --steps 50
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from commpress.bench.arguments import LIST_HELP, choice, integer, listed, method_list
from commpress.bench.catalog import METHODS, OPTIMIZERS, TASKS
from commpress.bench.progress import Progress
from commpress.errors import ConfigError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tasks",
        type=listed(choice(TASKS)),
        default=list(TASKS),
        help=f"tasks separated by ',' or ';' (default: {','.join(TASKS)})",
    )
    parser.add_argument(
        "--optimizers",
        type=listed(choice(OPTIMIZERS)),
        default=list(OPTIMIZERS),
        help=f"optimizers separated by ',' or ';' (default: {','.join(OPTIMIZERS)})",
    )
    parser.add_argument(
        "--methods",
        type=method_list(),
        default=list(METHODS),
        help=f"{LIST_HELP}; a row name ({', '.join(METHODS)}) is that row, anything else a method spec such as "
        "'topk:ratio=0.03' (default: every row; none is always run)",
    )
    parser.add_argument("--seeds", type=integer(1), default=3, help="seeds 0 .. N-1 per row (default 3)")
    parser.add_argument("--steps", type=integer(1), default=200, help="training steps per run (default 200)")
    parser.add_argument("--threads", type=integer(1), help="torch threads (default: torch's own choice)")
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart of the gaps (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def run(args: argparse.Namespace) -> int:
    import torch

    from commpress.bench.quality import run_suite
    from commpress.bench.quality_report import render, summarize, write_plot

    tasks, optimizers, methods = args.tasks, args.optimizers, args.methods
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install 'commpress[bench]'")
    if args.threads:
        torch.set_num_threads(args.threads)
    methods_run = len(dict.fromkeys(["none", *methods]))
    total = len(tasks) * len(optimizers) * methods_run * args.seeds
    bar = None if args.quiet else Progress(total, "commpress quality")
    done = 0

    def on_run(r) -> None:
        nonlocal done
        done += 1
        if bar is not None:
            bar.update(done, f"{r.task}/{r.optimizer}/{r.method}/seed {r.seed}")

    print(f"commpress quality: 2 simulated ranks, {args.steps} steps, seeds 0..{args.seeds - 1}, {total} runs", file=sys.stderr)
    runs = run_suite(tasks, optimizers, methods, list(range(args.seeds)), args.steps, on_run=on_run)
    rows = summarize(runs)
    print(render(rows, args.seeds))
    if args.plot:
        write_plot(rows, args.plot)
    return 0
