"""Time to a held-out loss under torchft, with a replica group killed and restarted on a
schedule: commpress (a DDP hook config or DiLoCo) against torchft's own DDP and DiLoCo.

    commpress linkemu --ranks 3 --rate 100mbit -- python -m commpress.bench.ft_race \\
        --mode commpress --config docs/configs/streaming-diloco.toml --target 1.9 --kill-every 40

One linkemu rank per replica group (one process each, its own link). Every rank runs a
supervisor that starts the trainer; the supervisor of ``--victim`` kills its trainer
(``SIGKILL``) after about ``--kill-every`` steps since it started, at a random moment of a
step (:class:`KillSchedule`), and starts a new one at once, which heals from a peer. Rank
0's supervisor also holds the lighthouse and a store where the trainers meet; rank 0's
replica is never killed and keeps the clock: the seconds of training (evaluations excluded)
until its own model's held-out loss, evaluated every ``--eval-every`` steps, is at or below
``--target``. Then every replica stops after the same manager step (two after rank 0's), so
DiLoCo's final syncs line up. The race's transformer and data (``commpress race``'s
defaults), AdamW at ``--lr``; replica r trains on the race's batches of rank r of
``WORLD_SIZE``.

Goodput is the time to target without failures (``--kill-every 0``) over the time with.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch

from commpress.bench.race import RaceTask

__all__ = ["main"]

MODES = ("commpress", "torchft-ddp", "torchft-diloco")
_DONE, _READY, _KILLS, _FINISHED = "done", "ready", "kills", "finished"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m commpress.bench.ft_race", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--config", help="commpress mode: the config (a DDP hook method, or [local_sgd] DiLoCo)")
    p.add_argument("--period", type=int, default=8, help="torchft-diloco: inner steps per sync (default 8)")
    p.add_argument("--outer", default="0.8,0.2", help="torchft-diloco: outer lr and Nesterov momentum (default 0.8,0.2)")
    p.add_argument("--target", type=float, required=True, help="the held-out loss to reach")
    p.add_argument("--max-steps", type=int, default=800, help="rank 0 stops here if the target is not reached")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument(
        "--kill-every", type=int, default=0, help="victim steps between kills, on average (KillSchedule; 0: no failures)"
    )
    p.add_argument("--kill-seed", type=int, default=0, help="seeds the kills' offsets (KillSchedule; default 0)")
    p.add_argument("--victim", type=int, default=None, help="the replica killed (default the last)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--join-timeout-ms",
        type=int,
        default=5000,
        help="the lighthouse's wait for every heartbeating replica to join a quorum (default 5000)",
    )
    p.add_argument("--json", help="rank 0 writes the result here")
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _env() -> tuple[int, int, str, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def _store(master: str, port: int, hold: bool = False) -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore(master, port + 1, is_master=hold, wait_for_workers=False, timeout=timedelta(seconds=600))


# ---- the supervisor ------------------------------------------------------------------------


def supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this rank's trainer, killing and restarting it on the victim's schedule."""
    rank, world, master, port = _env()
    victim = world - 1 if args.victim is None else args.victim
    lighthouse = None
    if rank == 0:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(
            bind=f"[::]:{port}", min_replicas=1, join_timeout_ms=args.join_timeout_ms, heartbeat_timeout_ms=2000
        )
    store = _store(master, port, hold=rank == 0)
    progress = f"/tmp/ft_race_progress_{os.getpid()}"
    command = [sys.executable, "-m", "commpress.bench.ft_race", *argv, "--trainer"]
    env = {**os.environ, "COMMPRESS_FT_PROGRESS": progress}
    schedule = KillSchedule(args.kill_every, args.kill_seed)
    while True:  # a trainer killed on schedule is started again; it heals from a peer
        child, first = subprocess.Popen(command, env=env), None
        due, fraction = schedule.next()
        while child.poll() is None:
            time.sleep(0.01)
            taken = _taken(progress)
            if taken and first is None:
                first = (time.monotonic(), taken)
            if rank != victim or not args.kill_every or taken < due or _done(store):
                continue
            assert first is not None
            step = (time.monotonic() - first[0]) / max(1, taken - first[1])  # its mean step so far
            time.sleep(fraction * step)  # a moment inside the step after the due one
            child.send_signal(signal.SIGKILL)
            child.wait()
            store.add(_KILLS, 1)
        if os.path.exists(progress):
            os.unlink(progress)
        if child.returncode == 0:
            break
        if rank != victim or _done(store):
            return child.returncode or 1
    if lighthouse is not None:  # the lighthouse and the store outlive every replica's final syncs
        deadline = time.monotonic() + 300
        while int(store.add(_FINISHED, 0)) < world and time.monotonic() < deadline:
            time.sleep(0.1)
        lighthouse.shutdown()
    return 0


class KillSchedule:
    """When the victim's trainers die: the k-th after ``every - 4`` to ``every + 3`` of its
    steps (uniform), at a uniformly random moment of the step after those, drawn from
    ``seed``: every run with the same seed kills at the same steps. Failures come at any
    moment, not in step with a method's syncs: a kill on the victim's ``every``-th step
    would land on a sync of every method whose period divides ``every`` (mid-collective,
    where replicas can disagree on the commit) and between the syncs of the others.
    Periods up to 8 that divide 8 see every position in their round equally often."""

    def __init__(self, every: int, seed: int) -> None:
        self.every = every
        self.rng = random.Random(seed)

    def next(self) -> tuple[int, float]:
        """The next trainer's kill: after how many of its steps, and how far into the next."""
        return max(1, self.every + self.rng.randrange(-4, 4)), self.rng.random()


def _done(store: torch.distributed.TCPStore) -> bool:
    """Whether rank 0 said stop (or is gone: its store closes after every replica finished)."""
    try:
        return store.check([_DONE])
    except torch.distributed.DistNetworkError:
        return True


def _taken(progress: str) -> int:
    try:
        with open(progress) as f:
            return int(f.read() or 0)
    except (FileNotFoundError, ValueError):
        return 0


# ---- the trainer ---------------------------------------------------------------------------


def train(args: argparse.Namespace) -> None:
    """One replica group's training under a torchft Manager until rank 0 says done."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    rank, world, master, port = _env()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    task = RaceTask()
    data = task.data()
    module = data.model()
    own = torch.distributed.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
    address = os.environ.get("COMMPRESS_LINKEMU_ADDR", "localhost")  # what the other replicas reach
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    manager = Manager(
        pg=pg,
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=60), device=torch.device("cpu")),
        hostname=address,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        replica_id=f"replica_{rank}",
        lighthouse_addr=f"http://{master}:{port}",
        rank=0,
        world_size=1,
        store_addr=address,
        store_port=own.port,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
        use_async_quorum=args.mode != "torchft-diloco",  # torchft's DiLoCo requires a synchronous quorum
    )
    step_fn, finish = _attach(args, module, manager)
    meet = _store(master, port)
    meet.add(_READY, 1)
    while int(meet.add(_READY, 0)) < world:
        time.sleep(0.05)
    if meet.check([_DONE]):  # started again after the others stopped: nothing to join
        meet.add(_FINISHED, 1)
        manager.shutdown(wait=False)
        return
    x_eval, y_eval = data.eval_batch(task.eval_size)
    clock, steps, curve, progress = 0.0, 0, [], os.environ.get("COMMPRESS_FT_PROGRESS")
    while not (meet.check([_DONE]) and manager.current_step() >= int(meet.get(_DONE))):
        x, y = data.batch(steps, rank, world)
        t0 = time.perf_counter()
        step_fn(x, y)
        clock += time.perf_counter() - t0
        steps += 1
        if progress:
            with open(progress, "w") as f:
                f.write(str(steps))
        if rank == 0 and not meet.check([_DONE]) and (steps % args.eval_every == 0 or steps >= args.max_steps):
            with torch.no_grad():
                loss = task.loss(module(x_eval), y_eval).item()
            curve.append((steps, round(clock, 3), loss, manager.num_participants()))
            if loss <= args.target or steps >= args.max_steps:
                # every replica stops after the same manager step (a committed sync or step), two ahead
                meet.set(_DONE, str(manager.current_step() + 2))
                _report(args, curve, int(meet.add(_KILLS, 0)), manager)
    finish()
    meet.add(_FINISHED, 1)
    manager.shutdown(wait=False)


def _attach(args: argparse.Namespace, module: torch.nn.Module, manager: Any) -> tuple[Any, Any]:
    """The mode's training step ``(x, y) -> None`` and its end-of-run call."""
    from torchft.optim import OptimizerWrapper

    inner = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.01)
    manager.register_state_dict_fn("model", module.load_state_dict, module.state_dict)
    manager.register_state_dict_fn("optimizer", inner.load_state_dict, inner.state_dict)
    if args.mode == "torchft-diloco":
        from torchft.local_sgd import DiLoCo

        lr, momentum = (float(v) for v in args.outer.split(","))
        outer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum, nesterov=True)
        diloco = DiLoCo(manager, [module], inner, outer, sync_every=args.period, should_quantize=True)
        diloco.__enter__()
        return _plain_step(module, inner), lambda: diloco.__exit__(None, None, None)
    if args.mode == "torchft-ddp":
        from torchft.ddp import DistributedDataParallel

        return _managed_step(DistributedDataParallel(manager, module), OptimizerWrapper(manager, inner)), lambda: None
    from commpress.config import Config
    from commpress.hooks import managed_ddp
    from commpress.registration import register

    cfg = Config.load(args.config)
    if cfg.section("local_sgd") is not None:
        reg = register(module, cfg, optimizer=inner, manager=manager)
        return _plain_step(module, inner), reg.finish
    ddp = managed_ddp(module)
    register(ddp, cfg, optimizer=inner, manager=manager, total_steps=args.max_steps)
    return _managed_step(ddp, OptimizerWrapper(manager, inner)), lambda: None


def _plain_step(module: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        RaceTask.loss(module(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def _managed_step(model: torch.nn.Module, opt: Any) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()  # starts the step's quorum
        RaceTask.loss(model(x), y).backward()
        opt.step()  # only if the manager commits

    return step


def _report(args: argparse.Namespace, curve: list[tuple[int, float, float, int]], kills: int, manager: Any) -> None:
    reached = [point for point in curve if point[2] <= args.target]
    result = {
        "mode": args.mode,
        "config": args.config,
        "link": os.environ.get("COMMPRESS_LINK", "local"),
        "replicas": int(os.environ["WORLD_SIZE"]),
        "target": args.target,
        "kill_every": args.kill_every,
        "kill_seed": args.kill_seed,
        "join_timeout_ms": args.join_timeout_ms,
        "kills": kills,
        "reached": bool(reached),
        "seconds_to_target": reached[0][1] if reached else None,
        "steps_to_target": reached[0][0] if reached else None,
        "manager_step": manager.current_step(),
        "curve": curve,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.mode == "commpress" and not args.config:
        raise SystemExit("--mode commpress needs --config")
    if args.trainer:
        train(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # past the manager's and gloo's threads, whose teardown at exit can abort the process
    return supervise(args, argv)


if __name__ == "__main__":
    sys.exit(main())
