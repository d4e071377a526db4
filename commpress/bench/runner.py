"""Measure every method on one rank of an initialized process group.

Each method gets a fresh model (same seed) wrapped in DDP, ``warmup`` untimed steps (DDP
rebuilds its buckets after the first; compressors that start late get going), then
``steps`` timed steps. A step is forward + backward (which waits for the gradient
communication) + optimizer step. Before the methods, the same steps run without DDP to
time the computation alone, so the time waiting on the network can be separated out.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from commpress.bench.methods import BenchMethod
from commpress.bench.workloads import make_workload
from commpress.comm.traffic import Traffic
from commpress.hooks import register
from commpress.terminal import Progress

__all__ = ["BenchPlan", "bench_rank"]


@dataclass(frozen=True)
class BenchPlan:
    """Everything every rank needs to run the same benchmark."""

    methods: tuple[BenchMethod, ...]
    workload: str = "gpt2"
    scale: float = 0.1
    batch: int = 8
    steps: int = 20
    warmup: int = 5
    bucket_cap_mb: float | None = None
    progress: bool = True


def bench_rank(rank: int, world_size: int, plan: BenchPlan) -> dict[str, Any]:
    """Run ``plan`` on this rank; every rank returns every rank's measurements."""
    task = make_workload(plan.workload, plan.scale, plan.batch)
    model = task.model()
    numel = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    total = len(plan.methods) + 1
    show = plan.progress and rank == 0
    compute = _timed_steps(task, None, plan, rank, world_size, _bar(show, f"[1/{total}] compute only", plan))
    methods = []
    for i, method in enumerate(plan.methods, start=2):
        bar = _bar(show, f"[{i}/{total}] {method.label}", plan)
        methods.append(_measure(task, method, plan, rank, world_size, grad_bytes, bar))
    mine = {"rank": rank, "host": socket.gethostname(), "compute_seconds": compute, "methods": methods}
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return {
        "link": os.environ.get("COMMPRESS_LINK", "local"),
        "workload": {"name": plan.workload, "scale": plan.scale, "batch": plan.batch, "numel": numel, "grad_bytes": grad_bytes},
        "world_size": world_size,
        "steps": plan.steps,
        "warmup": plan.warmup,
        "ranks": everyone,
    }


def _bar(show: bool, label: str, plan: BenchPlan) -> Callable[[int], None] | None:
    return Progress(plan.warmup + plan.steps, f"{label:<40.40}").update if show else None


def _measure(
    task: Any,
    method: BenchMethod,
    plan: BenchPlan,
    rank: int,
    world_size: int,
    grad_bytes: int,
    on_step: Callable[[int], None] | None,
) -> dict[str, Any]:
    if method.config is not None and method.config.section("local_sgd") is not None:
        return _measure_local_sgd(task, method, plan, rank, world_size, on_step)
    model = task.model()
    cap = plan.bucket_cap_mb
    if method.kind == "torch-powersgd":
        cap = grad_bytes / 2**20 + 1  # one bucket: PyTorch's hook fails on gloo with several
    ddp = DistributedDataParallel(model, **({"bucket_cap_mb": cap} if cap is not None else {}))
    traffic, counting = _attach(method, ddp, grad_bytes)
    with counting:
        times = _timed_steps(task, ddp, plan, rank, world_size, on_step, traffic)
    snap = traffic.snapshot()
    return {
        "label": method.label,
        "kind": method.kind,
        "note": method.note,
        "bucket_cap_mb": cap,
        "step_seconds": times,
        "bytes_sent": snap["bytes_sent"],
        "collectives": snap["collectives"],
        "compute_seconds": snap["compute_seconds"],
    }


def _attach(method: BenchMethod, ddp: DistributedDataParallel, grad_bytes: int) -> tuple[Traffic, Any]:
    """Register the method's hook; return its traffic counters and a context that counts
    what PyTorch's own hooks send."""
    if method.kind == "commpress":
        return register(ddp, method.config).traffic, contextlib.nullcontext()
    traffic = _PlainTraffic(grad_bytes) if method.kind == "ddp" else Traffic()
    if method.kind == "torch-fp16":
        ddp.register_comm_hook(None, _timed_hook(default_hooks.fp16_compress_hook, traffic))
    elif method.kind == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=method.params["rank"],
            start_powerSGD_iter=method.params["start_iter"],
            min_compression_rate=method.params["min_compression_rate"],
            random_seed=0,
        )
        ddp.register_comm_hook(state, _timed_hook(powerSGD_hook.powerSGD_hook, traffic))
    return traffic, _count_all_reduce(traffic) if method.kind != "ddp" else contextlib.nullcontext()


class _PlainTraffic(Traffic):
    """DDP's own all-reduce sends every gradient byte once per step (no hook to count it)."""

    def __init__(self, grad_bytes: int) -> None:
        super().__init__()
        self.grad_bytes = grad_bytes

    def step(self) -> None:
        self.add(nbytes=self.grad_bytes, collectives=1)


def _timed_hook(hook: Callable[[Any, Any], torch.futures.Future], traffic: Traffic) -> Callable[[Any, Any], torch.futures.Future]:
    """``hook`` counting the time it spends on the calling thread as compression time."""

    @functools.wraps(hook)
    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        t0 = time.perf_counter()
        try:
            return hook(state, bucket)
        finally:
            traffic.add(seconds=time.perf_counter() - t0)

    return timed


@contextlib.contextmanager
def _count_all_reduce(traffic: Traffic) -> Iterator[None]:
    """Count the payload of every ``torch.distributed.all_reduce`` call (PyTorch's hooks
    call it through the module attribute) while the context is open."""
    original = dist.all_reduce

    @functools.wraps(original)
    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        traffic.add(nbytes=tensor.numel() * tensor.element_size(), collectives=1)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def _timed_steps(
    task: Any,
    ddp: DistributedDataParallel | None,
    plan: BenchPlan,
    rank: int,
    world_size: int,
    on_step: Callable[[int], None] | None,
    traffic: Traffic | None = None,
) -> list[float]:
    """Wall time of each timed step (``ddp`` None: the bare model, no communication)."""
    model = ddp if ddp is not None else task.model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    times = []
    for step in range(plan.warmup + plan.steps):
        if step == plan.warmup:
            dist.barrier()
            if traffic is not None:
                traffic.reset()
        t0 = time.perf_counter()
        loss = task.loss(model, step, rank, world_size)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        if step >= plan.warmup:
            times.append(time.perf_counter() - t0)
            if isinstance(traffic, _PlainTraffic):
                traffic.step()
        if on_step is not None:
            on_step(step + 1)
    return times


def _measure_local_sgd(
    task: Any,
    method: BenchMethod,
    plan: BenchPlan,
    rank: int,
    world_size: int,
    on_step: Callable[[int], None] | None,
) -> dict[str, Any]:
    """A config with a ``[local_sgd]`` table: Local SGD or CO2 (no gradient all-reduce; the
    models are averaged every few steps). Each round's wall time is spread evenly over its
    steps, so the step time includes the averaging (a plain median would see only the
    local steps); a round cut by the end of the run counts what it took so far."""
    from commpress.local_sgd import from_config

    assert method.config is not None
    ddp = DistributedDataParallel(task.model(), **({"bucket_cap_mb": plan.bucket_cap_mb} if plan.bucket_cap_mb else {}))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    trainer = from_config(ddp, opt, method.config, total_steps=plan.warmup + plan.steps)
    times: list[float] = []
    current: list[float] = []
    for step in range(plan.warmup + plan.steps):
        if step == plan.warmup:
            dist.barrier()
            trainer.traffic.reset()
        t0 = time.perf_counter()
        loss = task.loss(ddp, step, rank, world_size)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        rounds = trainer.clock.rounds
        trainer.step()
        if step >= plan.warmup:
            current.append(time.perf_counter() - t0)
            if trainer.clock.rounds > rounds or step == plan.warmup + plan.steps - 1:
                times += [sum(current) / len(current)] * len(current)
                current = []
        if on_step is not None:
            on_step(step + 1)
    snap = trainer.traffic.snapshot()
    trainer.finish()
    return {
        "label": method.label,
        "kind": method.kind,
        "note": "round-averaged steps",
        "bucket_cap_mb": plan.bucket_cap_mb,
        "step_seconds": times,
        "bytes_sent": snap["bytes_sent"],
        "collectives": snap["collectives"],
        "compute_seconds": snap["compute_seconds"],
    }
