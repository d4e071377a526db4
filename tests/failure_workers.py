"""Rank processes for tests/test_failures.py: real gloo (or MPI) ranks where one peer dies,
stalls or disagrees on purpose, and every rank writes what it saw to ``rank<r>.json``.

Run as ``python failure_workers.py SCENARIO OUTDIR [PORT WORLD RANK]`` (gloo: the parent
holds the TCPStore at PORT) or under ``mpirun`` (``mpi-*`` scenarios: rank and world from
the launcher). A survivor records, per case: whether the failing call raised, the
exception's type, message and ``__cause__``, the seconds it took, whether a second call
failed at once, and whether the committed state stayed as it was before the failed step.
This module holds the scenarios and the entry point; the training setups, the recording and
the file barriers they share are in tests/failure_harness.py.

Ranks meet at phase boundaries through files in OUTDIR (never through the process group
that is about to break), so the peer that stalls stays silent on the network until every
survivor has finished the phase.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from failure_harness import (
    CONNECT_S,
    FIRST_FAILING_STEP,
    FSDP,
    TIMEOUT_S,
    Case,
    DDPCase,
    FSDPCase,
    LocalCase,
    Recorder,
    _groups,
    _mlp,
    _timed,
    arm,
    barrier,
    describe,
    fail,
    fail_concurrently,
    short_timeout,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import commpress
import commpress.fsdp
from commpress.compressors import available
from commpress.local_sgd import CO2, LocalSGD, from_config

#: method parameters that make every method compress the small test layers
PARAMS: dict[str, dict[str, Any]] = {
    "powersgd": {"rank": 2, "min_compression_rate": 0.0},
    "acpsgd": {"rank": 2, "min_compression_rate": 0.0},
    "topk": {"ratio": 0.3},
}
HIERARCHICAL = {"adaptive": True, "domains": [[0, 1], [2, 3]], "probe_ms": 2.0}


def _peer_cases(rank: int) -> dict[str, Case]:
    """Every method under DDP, Local SGD, CO2 (from a config) and FSDP2, each over its own group."""
    methods = available()
    groups = iter(_groups(len(methods) + 3))
    cases: dict[str, Case] = {
        f"ddp/{m}": DDPCase(rank, {"method": m, "params": PARAMS.get(m, {})}, next(groups)) for m in methods
    }
    g = next(groups)
    cases["local_sgd"] = LocalCase(rank, lambda model, opt: LocalSGD(model, opt, period=1, process_group=g))
    co2 = {"method": "bf16", "local_sgd": {"algorithm": "co2", "period": 1, "outer_momentum": 0.5}}
    g2 = next(groups)
    cases["co2"] = LocalCase(rank, lambda model, opt: from_config(model, opt, co2, process_group=g2))
    cases["fsdp2"] = FSDPCase(rank, DeviceMesh.from_group(next(groups), "cpu"))
    return cases


def lost_peer(rank: int, world: int, out: Path, make_cases: Callable[[int], dict[str, dict[str, Case]]]) -> None:
    """The last rank stalls (phase "stalled"), then dies (phase "dead") at step 2 of every
    case; the others record what they see."""
    rec = Recorder(out, rank)
    phases = make_cases(rank)
    for i in range(FIRST_FAILING_STEP):
        for cases in phases.values():
            for case in cases.values():
                case.step(i)
    rec.data["info"]["methods"] = available()
    rec.data["info"]["channel_timeouts"] = {
        f"{p}/{n}": c.channel_timeouts() for p, cases in phases.items() for n, c in cases.items()
    }
    rec.save()
    lost, survivors = world - 1, list(range(world - 1))
    if rank == lost:
        barrier(out, "stalled", rank, survivors)  # silent on the network until they are done
        os._exit(1)  # dead: no clean-up, sockets close
    arm(phases["stalled"])
    rec.data["cases"]["stalled"] = fail_concurrently(phases["stalled"])
    rec.save()
    barrier(out, "stalled", rank, [*survivors, lost])  # the lost rank's marker comes first
    arm(phases["dead"])
    rec.data["cases"]["dead"] = fail_concurrently(phases["dead"])
    rec.save()


def peers(rank: int, world: int, out: Path) -> None:
    lost_peer(rank, world, out, lambda r: {"stalled": _peer_cases(r), "dead": _peer_cases(r)})


def hierarchical(rank: int, world: int, out: Path) -> None:
    """4 ranks, domains [[0, 1], [2, 3]]: the hierarchical path (also while re-measuring
    the links) and plain DDP over the default group."""

    def cases(r: int) -> dict[str, dict[str, Case]]:
        topk = {"method": "topk", "params": PARAMS["topk"], "bandwidth": HIERARCHICAL}
        remeasure = {**topk, "bandwidth": {**HIERARCHICAL, "remeasure_every": FIRST_FAILING_STEP}}
        lowrank = {"method": "powersgd", "params": PARAMS["powersgd"], "bandwidth": HIERARCHICAL}
        return {
            "stalled": {
                "hierarchical/topk": DDPCase(r, topk),
                "hierarchical-remeasure/topk": DDPCase(r, remeasure),
                "ddp/fp16": DDPCase(r, {"method": "fp16"}),
            },
            "dead": {"hierarchical/powersgd": DDPCase(r, lowrank), "ddp/fp16": DDPCase(r, {"method": "fp16"})},
        }

    lost_peer(rank, world, out, cases)


def _agreement_cases(rank: int) -> dict[str, Callable[[], Any]]:
    """Entry points given a config that differs on rank 1 (each over the default group)."""
    other = rank == 1

    def ddp(config: dict[str, Any]) -> Callable[[], Any]:
        return lambda: commpress.register(DistributedDataParallel(_mlp()), config)

    def local(make: Callable[[nn.Module, torch.optim.Optimizer], Any]) -> Callable[[], Any]:
        def build() -> Any:
            model = _mlp()
            return make(model, torch.optim.SGD(model.parameters(), lr=0.1))

        return build

    override = [{"params": ["0.weight"], "method": "none"}]
    period = 3 if other else 2
    return {
        "register/method": ddp({"method": "topk", "params": PARAMS["topk"]} if other else {"method": "powersgd"}),
        "register/override": ddp({"method": "fp16", "overrides": override} if other else {"method": "fp16"}),
        "register/backend": ddp({"method": "fp16", "backend": "mpi" if other else "torch"}),
        "CommState/params": lambda: commpress.CommState(
            {"method": "topk", "params": {"ratio": 0.2 if other else 0.1}}, model=_mlp()
        ),
        "from_config/period": local(lambda m, o: from_config(m, o, {"local_sgd": {"period": period}})),
        "LocalSGD/period": local(lambda m, o: LocalSGD(m, o, period=period)),
        "CO2/outer_lr": local(lambda m, o: CO2(m, o, period=2, outer_lr=0.5 if other else 1.0)),
        "fsdp.apply/weight_bits": lambda: FSDPCase(
            rank, init_device_mesh("cpu", (dist.get_world_size(),)), {**FSDP, "weight_bits": 4 if other else 8}
        ),
    }


def agreement(rank: int, world: int, out: Path) -> None:
    """Every entry point with a config that differs across ranks; then check the default
    group still works (the error came from the check, not from a broken transport)."""
    rec = Recorder(out, rank)
    for name, build in _agreement_cases(rank).items():
        exc, elapsed = _timed(build)
        rec.data["cases"][name] = {"raised": exc is not None, "elapsed": elapsed, "error": describe(exc)}
        rec.save()
    ones = torch.ones(1)
    dist.all_reduce(ones)
    rec.data["info"]["group_still_works"] = ones.item() == world
    rec.save()


def absent(rank: int, world: int, out: Path) -> None:
    """Rank 1 wraps its models but never calls any commpress entry point; rank 0 calls
    each (concurrently, each over its own group; ``fsdp.apply`` over the default group)."""
    rec = Recorder(out, rank)
    groups = _groups(5)
    ddp = DistributedDataParallel(_mlp(), process_group=groups[0])  # both ranks wrap: DDP's own collectives
    fsdp_model = _mlp()
    fully_shard(fsdp_model, mesh=init_device_mesh("cpu", (world,)))
    if rank == 1:
        barrier(out, "done", rank, [0, 1])
        return
    short_timeout(groups)  # the wraps above ran under CONNECT_S; the calls below time out
    config = {"method": "fp16"}

    def local(make: Callable[[nn.Module, torch.optim.Optimizer], Any]) -> Callable[[], Any]:
        model = _mlp()
        return lambda: make(model, torch.optim.SGD(model.parameters(), lr=0.1))

    calls: dict[str, Callable[[], Any]] = {
        "register": lambda: commpress.register(ddp, config),
        "CommState": lambda: commpress.CommState(config, model=_mlp(), process_group=groups[1]),
        "from_config": local(lambda m, o: from_config(m, o, {"local_sgd": {"period": 2}}, process_group=groups[2])),
        "LocalSGD": local(lambda m, o: LocalSGD(m, o, period=2, process_group=groups[3])),
        "CO2": local(lambda m, o: CO2(m, o, period=2, process_group=groups[4])),
        "fsdp.apply": lambda: commpress.fsdp.apply(fsdp_model, FSDP),
    }

    def run(call: Callable[[], Any]) -> dict[str, Any]:
        exc, elapsed = _timed(call)
        return {"raised": exc is not None, "elapsed": elapsed, "error": describe(exc)}

    rec.data["cases"] = fail_concurrently(calls, run)
    rec.save()
    barrier(out, "done", rank, [0, 1])


def mpi_lost_peer(how: str, out: Path) -> None:
    """Under mpirun: DDP with ``backend = "mpi"``; rank 1 stalls or dies at step 2."""
    from commpress.comm.from_env import init_from_env

    launch = init_from_env("gloo", timeout=CONNECT_S)  # the MPI backend takes this timeout too
    rank = launch.rank
    rec = Recorder(out, rank)
    case = DDPCase(rank, {"method": "fp16", "backend": "mpi"})
    for i in range(FIRST_FAILING_STEP):
        case.step(i)
    rec.data["info"]["mpi_timeout"] = case.state.backend.timeout
    rec.save()
    case.state.backend.timeout = TIMEOUT_S  # the failing step alone runs under the short timeout
    if rank == 1:
        if how == "dead":
            os._exit(0)  # a clean exit code: mpirun would otherwise end the job itself
        time.sleep(3600)  # mpirun ends it once rank 0 has exited
    rec.data["cases"][how] = {"ddp/fp16": fail(case)}
    rec.save()


SCENARIOS = {"peers": peers, "hierarchical": hierarchical, "agreement": agreement, "absent": absent}


def load_every_kernel() -> None:
    """Every method's kernels loaded before any group exists (what ``register()`` does for
    its own method), so that no case's set-up compiles while its peer waits in the case's
    first collective."""
    for method in available():
        commpress.CommState({"method": method, "params": PARAMS.get(method, {})}, model=_mlp()).load_kernels()


def main(argv: list[str]) -> None:
    scenario, out = argv[0], Path(argv[1])
    torch.set_num_threads(1)
    load_every_kernel()
    if scenario.startswith("mpi-"):
        mpi_lost_peer(scenario.removeprefix("mpi-"), out)
        os._exit(0)  # a failed group cannot be destroyed cleanly; the results are written
    port, world, rank = (int(a) for a in argv[2:5])
    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=CONNECT_S))
    dist.barrier()  # every rank connected
    try:
        SCENARIOS[scenario](rank, world, out)
    except BaseException:
        (out / f"rank{rank}.crash").write_text(traceback.format_exc())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
