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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commpress.bench.attach import Counting, attach, bucket_cap
from commpress.bench.methods import BenchMethod
from commpress.bench.progress import Progress
from commpress.bench.workloads import make_workload
from commpress.comm.counters import Traffic
from commpress.layerwise.plan import PlanningCost

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
    #: step by step, each row in turn (all models built first), instead of row after row:
    #: a machine whose speed drifts then moves every row alike
    interleave: bool = False
    #: where the models and gradients live ("cpu", or "cuda" for this process's current GPU)
    device: str = "cpu"


def bench_rank(rank: int, world_size: int, plan: BenchPlan) -> dict[str, Any]:
    """Run ``plan`` on this rank; every rank returns every rank's measurements."""
    task = make_workload(plan.workload, plan.scale, plan.batch)
    model = task.model()
    numel = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    rows: list[Callable[[], _Run]] = [lambda: _Run(task, None, plan, rank, world_size, grad_bytes)]
    rows += [functools.partial(_row, task, method, plan, rank, world_size, grad_bytes) for method in plan.methods]
    show = plan.progress and rank == 0
    total = plan.warmup + plan.steps
    if plan.interleave:  # every row built first, then step by step each row in turn
        runs = [make() for make in rows]
        bar = _bar(show, f"[1/1] {len(runs)} rows interleaved", plan)
        for step in range(total):
            for run in runs:
                run.step(step)
            if bar is not None:
                bar(step + 1)
        results = [run.result() for run in runs]
    else:
        results = []
        for i, make in enumerate(rows, start=1):
            run = make()
            bar = _bar(show, f"[{i}/{len(rows)}] {run.label}", plan)
            for step in range(total):
                run.step(step)
                if bar is not None:
                    bar(step + 1)
            results.append(run.result())
            del run
    mine = {"rank": rank, "host": socket.gethostname(), "compute_seconds": results[0]["step_seconds"], "methods": results[1:]}
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return {
        "link": os.environ.get("COMMPRESS_LINK", "local"),
        "workload": {"name": plan.workload, "scale": plan.scale, "batch": plan.batch, "numel": numel, "grad_bytes": grad_bytes},
        "world_size": world_size,
        "steps": plan.steps,
        "warmup": plan.warmup,
        "interleaved": plan.interleave,
        "ranks": everyone,
    }


def _bar(show: bool, label: str, plan: BenchPlan) -> Callable[[int], None] | None:
    return Progress(plan.warmup + plan.steps, f"{label:<40.40}").update if show else None


def _device(plan: BenchPlan) -> torch.device:
    """The plan's device; ``cuda`` is this process's current GPU."""
    device = torch.device(plan.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _ddp(model: torch.nn.Module, plan: BenchPlan, cap: float | None) -> DistributedDataParallel:
    """``model`` (on the plan's device) in DDP with buckets of ``cap`` MB (None: DDP's default)."""
    kwargs: dict[str, Any] = {"bucket_cap_mb": cap} if cap is not None else {}
    device = _device(plan)
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    return DistributedDataParallel(model, **kwargs)


def _synchronize(plan: BenchPlan) -> None:
    """Wait for the step's kernels on a GPU (a step's time is then its run, not its queueing)."""
    if plan.device != "cpu":
        torch.cuda.synchronize()


def _row(task: Any, method: BenchMethod, plan: BenchPlan, rank: int, world_size: int, grad_bytes: int) -> _Run:
    """The run of one method: a Local SGD/CO2 trainer for configs with a ``[local_sgd]`` table."""
    if method.config is not None and method.config.section("local_sgd") is not None:
        return _LocalSGDRun(task, method, plan, rank, world_size)
    return _Run(task, method, plan, rank, world_size, grad_bytes)


class _Run:
    """One row: a fresh model (same seed for every row) wrapped in DDP with the method's hook
    (``method`` None: the bare model, no communication), its optimizer and step times."""

    def __init__(
        self, task: Any, method: BenchMethod | None, plan: BenchPlan, rank: int, world_size: int, grad_bytes: int
    ) -> None:
        self.task, self.method, self.plan, self.rank, self.world_size = task, method, plan, rank, world_size
        self.label = "compute only" if method is None else method.label
        self.times: list[float] = []
        self.cap = plan.bucket_cap_mb
        self.traffic: Traffic | None = None
        self.counting: Counting = contextlib.nullcontext
        self.planning: PlanningCost | None = None  # a [layerwise] row's planning cost
        self.planning_before: dict[str, float] = {}  # ... when the timed steps began
        model = task.model().to(_device(plan))
        if method is not None:
            self.cap = bucket_cap(method, grad_bytes, plan.bucket_cap_mb)
            model = _ddp(model, plan, self.cap)
            self.traffic, self.counting, self.planning = attach(method, model, grad_bytes)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step(self, step: int) -> None:
        """Training step ``step``; timed from step ``plan.warmup`` on (a barrier first)."""
        if step == self.plan.warmup:
            dist.barrier()
            if self.traffic is not None:
                self.traffic.reset()
            if self.planning is not None:
                self.planning_before = self.planning.snapshot()
        t0 = time.perf_counter()
        with self.counting():
            loss = self.task.loss(self.model, step, self.rank, self.world_size)
            self.opt.zero_grad(set_to_none=False)
            loss.backward()
            self.opt.step()
            _synchronize(self.plan)
        if step >= self.plan.warmup:
            self.times.append(time.perf_counter() - t0)

    def result(self) -> dict[str, Any]:
        if self.method is None:
            return {"step_seconds": self.times}
        assert self.traffic is not None
        row = _method_row(self.method, self.method.note, self.cap, self.times, self.traffic)
        if self.planning is not None:
            layerwise = self.method.config.section("layerwise")
            run = self.planning.snapshot()
            timed = {k: v - self.planning_before[k] for k, v in run.items()}
            row["layerwise"] = {"every": layerwise.every, "run": run, "timed": timed}
        return row


class _LocalSGDRun:
    """A config with a ``[local_sgd]`` table: Local SGD or CO2 (no gradient all-reduce; the
    models are averaged every few steps). Each round's wall time is spread evenly over its
    steps, so the step time includes the averaging (a plain median would see only the
    local steps); a round cut by the end of the run counts what it took so far."""

    def __init__(self, task: Any, method: BenchMethod, plan: BenchPlan, rank: int, world_size: int) -> None:
        from commpress.local_sgd import from_config

        assert method.config is not None
        self.task, self.method, self.plan, self.rank, self.world_size = task, method, plan, rank, world_size
        self.label = method.label
        self.ddp = _ddp(task.model().to(_device(plan)), plan, plan.bucket_cap_mb or None)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-3, momentum=0.9)
        self.trainer = from_config(self.ddp, self.opt, method.config, total_steps=plan.warmup + plan.steps)
        self.times: list[float] = []
        self.current: list[float] = []

    def step(self, step: int) -> None:
        if step == self.plan.warmup:
            dist.barrier()
            self.trainer.traffic.reset()
        t0 = time.perf_counter()
        loss = self.task.loss(self.ddp, step, self.rank, self.world_size)
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        rounds = self.trainer.clock.rounds
        self.trainer.step()
        _synchronize(self.plan)
        if step >= self.plan.warmup:
            self.current.append(time.perf_counter() - t0)
            if self.trainer.clock.rounds > rounds or step == self.plan.warmup + self.plan.steps - 1:
                self.times += [sum(self.current) / len(self.current)] * len(self.current)
                self.current = []

    def result(self) -> dict[str, Any]:
        row = _method_row(self.method, "round-averaged steps", self.plan.bucket_cap_mb, self.times, self.trainer.traffic)
        self.trainer.finish()
        return row


def _method_row(method: BenchMethod, note: str, cap: float | None, times: list[float], traffic: Traffic) -> dict[str, Any]:
    """A method's measurements as every rank reports them."""
    snap = traffic.snapshot()
    return {
        "label": method.label,
        "kind": method.kind,
        "note": note,
        "bucket_cap_mb": cap,
        "step_seconds": times,
        "bytes_sent": snap["bytes_sent"],
        "collectives": snap["collectives"],
        "compute_seconds": snap["compute_seconds"],
        "layerwise": None,  # a [layerwise] row's planning cost: the whole run's and the timed steps'
    }
