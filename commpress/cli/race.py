"""Race every method to the same held-out loss and compare wall-clock time to get there.

Real training of a real task on text that ships with Python (a GPT-2-like character
transformer by default, or the demo's character MLP), every method on the same seed and
data: plain DDP (``ddp``), PyTorch's ``torch-fp16`` and ``torch-powersgd`` hooks (the
latter in one DDP bucket: on gloo it fails with several), and any commpress method spec or
config file (hooks, Local SGD/CO2). The target is the held-out loss ``ddp`` reaches at the
end of a real run, ``--target-steps`` steps (default 400), or ``--target``; the learning rate
warms up and decays along a cosine to a tenth at ``--target-steps`` (``--schedule constant``:
the peak rate throughout), and every row runs at least that far, so its loss there, at equal
steps, stands beside its time to the target. Each row shows
its steps to target and step time as factors of ddp's, beside the ceiling: ddp's step time
over the computation alone's, timed in the same run. Launch with ``--local N``, ``torchrun``,
``mpirun``, or under ``commpress linkemu`` for real throttled links. Rank 0 prints the
table; ``--json`` and ``--plot`` save it.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from commpress.bench.arguments import integer, number
from commpress.cli.ranks import add_method_arguments, add_rank_arguments, check_outputs, methods_from_args

__all__ = ["DEFAULT_METHODS", "add_arguments", "run"]

#: Rows when neither ``--methods`` nor ``--config`` is given.
DEFAULT_METHODS = "ddp;torch-fp16;torch-powersgd:rank=4;fp16;powersgd:rank=4;acpsgd:rank=4;topk:ratio=0.01"
_DEFAULT_TARGET_STEPS = 400


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_method_arguments(parser, f"(default '{DEFAULT_METHODS}'); ddp is added first when the target comes from it")
    parser.add_argument("--task", default="transformer", help="transformer (default) or charlm (the demo's MLP)")
    parser.add_argument("--width", type=integer(1), default=256, help="transformer width (default 256)")
    parser.add_argument("--layers", type=integer(1), default=4, help="transformer layers (default 4)")
    parser.add_argument("--heads", type=integer(1), default=4, help="transformer attention heads (default 4)")
    parser.add_argument("--context", type=integer(1), default=64, help="characters per window (default 64)")
    parser.add_argument("--batch", type=integer(1), default=16, help="windows per rank and step (default 16)")
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "sgd", "muon"),
        help="AdamW, SGD with momentum, or muon: torch.optim.Muon on the hidden matrices and AdamW on the rest",
    )
    parser.add_argument("--lr", type=number(0), help="peak learning rate (default: by task and optimizer)")
    parser.add_argument(
        "--schedule",
        default="cosine",
        choices=("cosine", "constant"),
        help="cosine (default): linear warm-up, then cosine decay to lr / 10 at --target-steps, as users train; "
        "constant: lr throughout",
    )
    parser.add_argument(
        "--lr-warmup",
        type=integer(0),
        metavar="N",
        help="the cosine schedule's warm-up steps (default 5%% of --target-steps)",
    )
    parser.add_argument("--target", type=number(0), metavar="LOSS", help="the held-out loss to reach")
    parser.add_argument(
        "--target-steps",
        type=integer(1),
        metavar="N",
        help=f"without --target: the target is ddp's held-out loss at the end of an N-step run (default {_DEFAULT_TARGET_STEPS})",
    )
    parser.add_argument(
        "--max-steps",
        type=integer(1),
        help="stop a method that has not reached the target after this many steps (default twice the target steps)",
    )
    parser.add_argument("--max-seconds", type=number(0), help="stop a method whose clock passes this many seconds")
    parser.add_argument("--eval-every", type=integer(1), default=10, metavar="E", help="evaluate every E steps (default 10)")
    parser.add_argument(
        "--warmup",
        type=integer(0),
        default=2,
        help="untimed steps of each method on a throwaway model first, so one-off costs (kernel compilation) stay "
        "off the clock (default 2)",
    )
    parser.add_argument(
        "--compute-steps",
        type=integer(1),
        default=20,
        metavar="N",
        help="timed steps of the computation alone (no communication), for the ceiling (default 20)",
    )
    parser.add_argument("--eval-size", type=integer(1), default=128, help="held-out windows per evaluation (default 128)")
    parser.add_argument(
        "--smooth",
        type=integer(1),
        default=5,
        metavar="K",
        help="evaluations averaged, centred, for the target and each row's crossing (default 5; odd; 1: single "
        "evaluations): late in a run one evaluation's noise moves a crossing by several evaluations",
    )
    parser.add_argument(
        "--seed",
        type=integer(0),
        default=0,
        help="the model's initialisation and the batches (default 0); every row of one run shares it, so repeat "
        "a run with other seeds to see how far its step counts scatter",
    )
    parser.add_argument(
        "--shards",
        type=integer(1),
        default=1,
        metavar="S",
        help="shard the model with FSDP2 inside replica groups of S consecutive ranks (default 1: DDP); ddp is then "
        "HSDP and each config is registered with the (groups, S) mesh",
    )
    add_rank_arguments(parser, plot="held-out loss against wall-clock seconds per method", bucket="; torch-powersgd: 1 bucket")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def plan_from_args(args: argparse.Namespace) -> Any:
    """Validate the command line into a :class:`~commpress.bench.race.RacePlan`
    (ConfigError on bad values)."""
    from commpress.bench.methods import parse_methods
    from commpress.bench.race import LEARNING_RATES, RacePlan, RaceTask
    from commpress.errors import ConfigError

    if args.target is not None and args.target_steps is not None:
        raise ConfigError("--target and --target-steps are not accepted together; the target is one or the other")
    target_steps = args.target_steps or _DEFAULT_TARGET_STEPS
    max_steps = args.max_steps or 2 * target_steps
    if args.target is None and max_steps < target_steps:
        raise ConfigError(f"--max-steps = {max_steps} is not accepted; expected at least --target-steps = {target_steps}")
    methods = methods_from_args(args, functools.partial(parse_methods, DEFAULT_METHODS))
    if args.target is None:  # the reference runs first: it sets the target
        ddp = [m for m in methods if m.kind == "ddp"] or parse_methods("ddp")
        methods = [ddp[0], *(m for m in methods if m is not ddp[0])]
    check_outputs(args)
    task = RaceTask(args.task, args.batch, args.context, args.width, args.layers, args.heads, args.eval_size, args.seed)
    return RacePlan(
        methods=tuple(methods),
        task=task,
        optimizer=args.optimizer,
        lr=args.lr or LEARNING_RATES[(task.name, args.optimizer)],
        target=args.target,
        target_steps=target_steps,
        max_steps=max_steps,
        max_seconds=args.max_seconds,
        eval_every=args.eval_every,
        warmup=args.warmup,
        compute_steps=args.compute_steps,
        bucket_cap_mb=args.bucket_cap_mb,
        progress=not args.quiet,
        shards=args.shards,
        smooth=args.smooth,
        schedule=args.schedule,
        lr_warmup=args.lr_warmup,
    )


def run(args: argparse.Namespace) -> int:
    from commpress.bench import race_report
    from commpress.bench.race import race_rank
    from commpress.cli.ranks import run_and_report

    plan = plan_from_args(args)
    banner = functools.partial(_banner, plan)
    return run_and_report(race_rank, plan, args, "race", banner, race_report, timeout=24 * 3600.0)


def _banner(plan: Any, world: int, how: str) -> None:
    print(f"commpress race: {len(plan.methods)} methods, {world} ranks ({how}), task {plan.task.name}", file=sys.stderr)
