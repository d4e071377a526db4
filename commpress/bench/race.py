"""Race every method to a held-out loss in wall-clock time, on one rank of a process group.

Each method trains a fresh model (same seed, same batches per step and rank, same
optimizer) wrapped in DDP with the method's gradient exchange: DDP's own, PyTorch's hooks
(:mod:`commpress.bench.attach`), or a commpress config applied by :func:`commpress.register`
with the optimizer (the DDP hook, Local SGD/CO2/DiLoCo, 1-bit Adam). Every ``eval_every`` steps the
clock stops and the ranks evaluate the held-out batch, each its share, with its own model;
the loss over the whole batch is the curve's point. The clock counts training steps only
(the slowest rank's). A method stops at the first evaluation at or below the target, at
``max_steps``, once its clock passes ``max_seconds``, or where it diverges (a non-finite
average, which every rank sees: the row says so and the race goes on). Without a given target, ``ddp``
runs first for ``target_steps`` steps (``max_seconds`` does not stop it) and its held-out
loss there, at the end of a real run, is the target. With ``smooth`` = k > 1 every point
is the centred mean of k evaluations (:func:`commpress.bench.race_report.crossing`): ddp
runs k // 2 evaluations past ``target_steps`` and each row k // 2 past its crossing.

Before the methods, the computation alone is timed: the same model and optimizer stepping
on the same batches with no DDP and no communication, every rank at once. DDP's step time
over it is the most any exchange can win per step (the race's ceiling at DDP's steps).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from commpress.bench.attach import attach, bucket_cap, count_plain
from commpress.bench.methods import BenchMethod
from commpress.bench.optimizers import make_optimizer, set_lr
from commpress.bench.progress import Progress
from commpress.bench.race_report import crossing, reference_target
from commpress.bench.sharding import replica_mesh, shard_model
from commpress.comm import Traffic
from commpress.errors import ConfigError
from commpress.registration import register
from commpress.workloads.charlm import CharTask
from commpress.workloads.schedule import Schedule
from commpress.workloads.synthetic import CharTransformerTask

__all__ = ["LEARNING_RATES", "TASKS", "RacePlan", "RaceTask", "race_rank"]

TASKS = ("transformer", "charlm")
#: Default (peak) learning rate by (task, optimizer).
LEARNING_RATES = {
    ("transformer", "adamw"): 1e-3,
    ("transformer", "sgd"): 0.05,
    ("charlm", "adamw"): 6e-3,
    ("charlm", "sgd"): 0.2,
    # Muon's (scaled to AdamW's RMS) on the hidden matrices, AdamW's rate on the rest: the
    # best of 1e-3 .. 1.6e-2 (doubling) under the schedule (docs/muon.md)
    ("transformer", "muon"): 8e-3,
    ("charlm", "muon"): 6e-3,
}


@dataclass(frozen=True)
class RaceTask:
    """The model and data of a race: ``transformer`` (a causal transformer over characters,
    GPT-2-like at the default size) or ``charlm`` (the demo's character MLP), both on the
    standard library's text; ``width``, ``layers`` and ``heads`` shape the transformer."""

    name: str = "transformer"
    batch: int = 16
    context: int = 64
    width: int = 256
    layers: int = 4
    heads: int = 4
    eval_size: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ConfigError(f"task = {self.name!r} is not accepted; accepted: {', '.join(TASKS)}")
        if self.name == "transformer" and self.width % self.heads:
            raise ConfigError(f"width = {self.width} is not accepted; expected a multiple of heads = {self.heads}")

    def data(self) -> CharTask | CharTransformerTask:
        if self.name == "charlm":
            return CharTask(context=self.context, batch_size=self.batch, seed=self.seed)
        return CharTransformerTask(self.context, self.batch, self.seed, self.width, self.layers, self.heads)

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


@dataclass(frozen=True)
class RacePlan:
    """Everything every rank needs to run the same race."""

    methods: tuple[BenchMethod, ...]
    task: RaceTask = RaceTask()
    optimizer: str = "adamw"
    lr: float = 1e-3
    #: the loss to reach; None: ``ddp``'s held-out loss after ``target_steps``
    target: float | None = None
    target_steps: int = 400
    max_steps: int = 800
    max_seconds: float | None = None
    eval_every: int = 10
    #: untimed steps of each method on a throwaway model first: one-off costs (compiling
    #: the CPU kernels, the allocator's first buffers) stay off the clock
    warmup: int = 2
    #: timed steps of the computation alone (after ``warmup`` untimed ones)
    compute_steps: int = 20
    bucket_cap_mb: float | None = None
    progress: bool = True
    #: ranks per replica group of an FSDP2-sharded model (1: DDP); ``ddp`` is then HSDP
    shards: int = 1
    #: evaluations averaged (centred) for the target and every crossing; odd; 1: single points
    smooth: int = 5
    #: ``cosine``: warm-up, then cosine decay to lr / 10 at ``target_steps``; ``constant``: lr throughout
    schedule: str = "cosine"
    #: the schedule's warm-up steps (None: 5% of ``target_steps``)
    lr_warmup: int | None = None

    @property
    def warmup_steps(self) -> int:
        """The schedule's warm-up steps."""
        return self.target_steps // 20 if self.lr_warmup is None else self.lr_warmup

    @property
    def rest_lr(self) -> float | None:
        """Under ``muon``, the peak learning rate of AdamW on what Muon does not step: the
        task's AdamW rate (None for the other optimizers)."""
        return LEARNING_RATES[(self.task.name, "adamw")] if self.optimizer == "muon" else None

    @property
    def lr_at(self) -> Schedule:
        """The learning rate of every step, the same for every row."""
        return Schedule(self.schedule, self.lr, self.target_steps, self.warmup_steps)

    def __post_init__(self) -> None:
        if self.target is None and (not self.methods or self.methods[0].kind != "ddp"):
            raise ConfigError("without a target, the first method must be ddp: its loss after target_steps is the target")
        if self.smooth < 1 or self.smooth % 2 == 0:
            raise ConfigError(f"smooth = {self.smooth} is not accepted; expected an odd number of evaluations >= 1")
        if self.target is None and self.smooth > 1 and self.target_steps % self.eval_every:
            raise ConfigError(
                f"target_steps = {self.target_steps} is not accepted with smooth = {self.smooth}: expected a multiple of "
                f"eval_every = {self.eval_every}, so that the target is centred on an evaluation"
            )
        if self.compute_steps < 1:
            raise ConfigError(f"compute_steps = {self.compute_steps} is not accepted; expected at least 1")
        Schedule(self.schedule, self.lr, self.target_steps, self.warmup_steps)  # refuses bad settings
        others = [m.label for m in self.methods if m.kind not in ("ddp", "commpress")]
        if self.shards > 1 and others:
            raise ConfigError(
                f"--shards = {self.shards}: {', '.join(others)} not accepted; a sharded race takes ddp (HSDP) and "
                "commpress configs (the cross-group hook, [local_sgd] over the replica groups)"
            )


def race_rank(rank: int, world_size: int, plan: RacePlan) -> dict[str, Any]:
    """Run ``plan`` on this rank; every rank returns the same result (points are agreed
    over the ranks as they are taken)."""
    data = plan.task.data()
    x, y = data.eval_batch(plan.task.eval_size)
    held_out = x[rank::world_size], y[rank::world_size]
    model = data.model()
    numel = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    target, target_source = plan.target, "given"
    compute_only = _compute_only(data, plan, rank, world_size)
    mesh = replica_mesh(world_size, plan.shards) if plan.shards > 1 else None
    rows = []
    for i, method in enumerate(plan.methods, start=1):
        reference = target is None and method.kind == "ddp"
        stop_at = _at_target_steps(plan) if reference else plan.max_steps
        label = f"[{i}/{len(plan.methods)}] {method.label}"
        bar = Progress(stop_at, f"{label:<40.40}").update if plan.progress and rank == 0 else None
        if plan.warmup:
            _warm_up(_Racer(data, method, plan, grad_bytes, plan.warmup, mesh), rank, world_size)
        row = _Racer(data, method, plan, grad_bytes, stop_at, mesh).run(rank, world_size, held_out, target, bar)
        if reference:
            target = reference_target(row["curve"], plan.target_steps, plan.smooth)
            target_source = f"ddp after {plan.target_steps} steps"
            if plan.smooth > 1:
                target_source += f", the mean of its {plan.smooth} evaluations centred there"
        rows.append(row)
    return {
        "target": target,
        "target_source": target_source,
        "link": os.environ.get("COMMPRESS_LINK", "local"),
        "world_size": world_size,
        "shards": plan.shards,
        "task": {**asdict(plan.task), "numel": numel, "grad_bytes": grad_bytes},
        "optimizer": plan.optimizer,
        "rest_lr": plan.rest_lr,
        "lr": plan.lr,
        "schedule": plan.lr_at.describe(),
        "target_steps": plan.target_steps,
        "eval_every": plan.eval_every,
        "smooth": plan.smooth,
        "warmup": plan.warmup,
        "max_steps": plan.max_steps,
        "max_seconds": plan.max_seconds,
        "compute_only": compute_only,
        "rows": rows,
    }


def _at_target_steps(plan: RacePlan) -> int:
    """The steps a row runs at least: its (smoothed) loss at ``target_steps`` is then known,
    every row's at the same step (under a schedule, the end of the run users train)."""
    return plan.target_steps + plan.smooth // 2 * plan.eval_every


def _compute_only(data: Any, plan: RacePlan, rank: int, world: int) -> dict[str, Any]:
    """The computation alone: a fresh model and the race's optimizer stepping on this
    rank's batches with no DDP, hook or collective, all ranks at once (so they share the
    cores as the race's rows do); ``warmup`` untimed steps, then ``compute_steps`` timed.
    The clock is the slowest rank's, as in the race."""
    model = data.model()
    opt = make_optimizer(plan.optimizer, model, plan.lr, plan.rest_lr)
    bar = Progress(plan.compute_steps, f"{'[0] computation alone':<40.40}").update if plan.progress and rank == 0 else None
    clock = 0.0
    for step in range(plan.warmup + plan.compute_steps):
        if step == plan.warmup:
            dist.barrier()
        x, y = data.batch(step, rank, world)
        t0 = time.perf_counter()
        loss = plan.task.loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        if step >= plan.warmup:
            clock += time.perf_counter() - t0
            if bar is not None:
                bar(step + 1 - plan.warmup)
    agreed = torch.tensor([clock], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return {"steps": plan.compute_steps, "seconds": agreed.item()}


def _warm_up(spare: _Racer, rank: int, world: int) -> None:
    """``spare``'s first steps, off the clock; the model is thrown away (and a divergence
    with it: the timed run reports its own)."""
    with contextlib.suppress(FloatingPointError):
        for step in range(spare.stop_at):
            spare.train(spare.data.batch(step, rank, world), step)
        spare.finish()


#: Tables whose method exchanges the whole model or momentum, not DDP's buckets: DDP keeps
#: its own bucket size for them.
WHOLE_MODEL = ("local_sgd", "onebit_adam")


class _Racer:
    """One method's run: its model, optimizer, gradient exchange and clock. With a
    ``mesh`` the model is sharded inside replica groups: ``ddp`` is HSDP, a commpress
    config is registered with ``mesh=``."""

    def __init__(self, data: Any, method: BenchMethod, plan: RacePlan, grad_bytes: int, stop_at: int, mesh: Any = None) -> None:
        self.data, self.method, self.plan, self.stop_at = data, method, plan, stop_at
        self.model = data.model()
        whole_model = method.config is not None and any(method.config.section(t) is not None for t in WHOLE_MODEL)
        self.cap = plan.bucket_cap_mb if whole_model else bucket_cap(method, grad_bytes, plan.bucket_cap_mb)
        if mesh is not None:
            self.cap, self.ddp = None, shard_model(self.model, mesh, hsdp=method.kind == "ddp")
        else:
            self.ddp = DistributedDataParallel(self.model, **({"bucket_cap_mb": self.cap} if self.cap is not None else {}))
        self.opt = make_optimizer(plan.optimizer, self.ddp, plan.lr, plan.rest_lr)
        self.update = self.opt.step
        self.finish: Callable[[], Any] = lambda: None
        self.note = method.note
        self.counting: Callable[[], Any]
        if method.kind == "commpress":  # every table of the config, as a user's one call applies it
            reg = register(self.ddp, method.config, optimizer=self.opt, total_steps=plan.max_steps, mesh=mesh)
            self.traffic, self.counting, self.finish = reg.traffic, contextlib.nullcontext, reg.finish
            self.note = "local models averaged" if reg.local_sgd is not None else method.note
        elif mesh is not None:  # HSDP: FSDP2's own all-reduce sends each rank's gradient shard once per step
            self.traffic = Traffic()
            self.counting = functools.partial(count_plain, self.traffic, grad_bytes // plan.shards)
        else:
            self.traffic, self.counting, _ = attach(method, self.ddp, grad_bytes, self.opt)

    def run(
        self, rank: int, world: int, held_out: tuple[torch.Tensor, torch.Tensor], target: float | None, bar: Any
    ) -> dict[str, Any]:
        """Train until the target, the step cap or the time cap; the row's curve and bytes."""
        clock, steps = 0.0, 0
        diverged: dict[str, Any] | None = None
        curve = [(0, 0.0, self._evaluate(held_out))]
        dist.barrier()
        while steps < self.stop_at:
            batch = self.data.batch(steps, rank, world)
            t0 = time.perf_counter()
            try:
                self.train(batch, steps)
            except FloatingPointError as exc:  # every rank raises it: the average they all hold is not finite
                diverged = {"step": steps + 1, "error": str(exc)}
                break
            clock += time.perf_counter() - t0
            steps += 1
            if bar is not None:
                bar(steps)
            if steps % self.plan.eval_every and steps < self.stop_at:
                continue
            agreed = torch.tensor([clock], dtype=torch.float64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            curve.append((steps, agreed.item(), self._evaluate(held_out)))
            dist.barrier()  # every rank starts the next step's clock together
            # the reference run (no target yet) always runs its target_steps; every row runs
            # at least that far (its loss at target_steps), then on to the target
            capped = self.plan.max_seconds is not None and curve[-1][1] >= self.plan.max_seconds
            crossed = target is not None and crossing(curve, target, self.plan.smooth) is not None
            if target is not None and (capped or (crossed and steps >= _at_target_steps(self.plan))):
                break
        if bar is not None and steps < self.stop_at:
            bar(self.stop_at, f"{'diverged' if diverged else 'stopped'} after {steps} steps")  # closes the progress line
        if diverged is None:  # a diverged run's last sync stopped it: nothing more to land
            self.finish()
        sent = torch.tensor([self.traffic.snapshot()["bytes_sent"] / steps], dtype=torch.float64)
        dist.all_reduce(sent)
        return {
            "method": self.method.label,
            "kind": self.method.kind,
            "note": self.note,
            "bucket_cap_mb": self.cap,
            "curve": curve,
            "bytes_per_step": sent.item() / world,
            "diverged": diverged,
        }

    def train(self, batch: tuple[torch.Tensor, torch.Tensor], step: int) -> None:
        """Training step ``step`` (0-based) on ``batch``, at the schedule's learning rate."""
        x, y = batch
        set_lr(self.opt, self.plan.lr_at(step))
        with self.counting():
            loss = self.plan.task.loss(self.ddp(x), y)
            self.opt.zero_grad(set_to_none=False)
            loss.backward()
            self.update()

    def _evaluate(self, held_out: tuple[torch.Tensor, torch.Tensor]) -> float:
        """The held-out loss: each rank takes its share of the batch (``held_out`` is this
        rank's), the ranks' sums are added (Local SGD: each rank's own model, mid-round too)."""
        x, y = held_out
        with torch.no_grad():
            out = self.model(x)
            total = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")
        agreed = torch.tensor([total.item(), y.numel()], dtype=torch.float64)
        dist.all_reduce(agreed)
        return (agreed[0] / agreed[1]).item()
