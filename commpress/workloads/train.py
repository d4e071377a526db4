"""One DDP training run of the demo task on an initialized process group.

Shared by ``commpress demo`` and the multi-rank tests so both train exactly the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from commpress.config import Config
from commpress.hooks import register_ddp_hook
from commpress.workloads.charlm import CharTask
from commpress.workloads.schedule import Schedule

__all__ = ["TrainResult", "cosine_lr", "train_ddp", "train_local_sgd"]


@dataclass
class TrainResult:
    """What one rank saw in one run."""

    losses: list[float]
    eval_loss: float
    bytes_per_step: float
    step_seconds: float  # median wall time of a step after the first few
    compute_seconds_per_step: float  # time inside compressor code
    params: torch.Tensor | None = None  # flat final parameters, when asked for
    state: dict[str, Any] | None = field(default=None, repr=False)  # CommState.state_dict()


def cosine_lr(base_lr: float, steps: int) -> Callable[[int], float]:
    """The learning rate at each step: cosine decay from ``base_lr`` to 0 over ``steps``, no warm-up."""
    return Schedule("cosine", base_lr, steps, warmup=0, floor=0.0)


def _setup(
    task: CharTask, lr: float, bucket_cap_mb: float | None
) -> tuple[torch.nn.Module, DistributedDataParallel, torch.optim.Optimizer]:
    """The demo model, its DDP wrapper and SGD with momentum (same on every path)."""
    model = task.model()
    kwargs = {"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb is not None else {}
    ddp = DistributedDataParallel(model, **kwargs)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)


def _run_steps(
    ddp: DistributedDataParallel,
    opt: torch.optim.Optimizer,
    update: Callable[[], Any],
    task: CharTask,
    steps: int,
    lr: float,
    on_step: Callable[[int], None] | None,
) -> tuple[list[float], list[float]]:
    """The training loop under a cosine schedule; ``update`` applies the step (the
    optimizer's, or a Local SGD trainer's). Returns (losses, step wall times)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule = cosine_lr(lr, steps)
    losses, times = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        x, y = task.batch(step, rank, world)
        t0 = time.perf_counter()
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        update()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1)
    return losses, times


def _eval_loss(model: torch.nn.Module, task: CharTask) -> float:
    """Loss of ``model`` on the task's held-out batch."""
    xe, ye = task.eval_batch()
    with torch.no_grad():
        return F.cross_entropy(model(xe), ye).item()


def train_ddp(
    config: Mapping[str, Any] | str | None,
    steps: int = 200,
    lr: float = 0.2,
    task: CharTask | None = None,
    bucket_cap_mb: float | None = None,
    return_params: bool = False,
    hook: Callable[[DistributedDataParallel], Any] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train the demo model with DDP and the commpress ``config`` (None: DDP's own all-reduce;
    ``hook`` instead registers some other comm hook). SGD with momentum, cosine schedule.
    ``on_step(n)`` is called after every step (progress displays). A config with a
    ``[local_sgd]`` table trains with Local SGD or CO2 instead (:func:`train_local_sgd`)."""

    if config is not None and Config.load(config).section("local_sgd") is not None:
        if hook is not None:
            raise ValueError("hook= cannot be combined with a [local_sgd] config: Local SGD registers its own hook")
        return train_local_sgd(config, steps, lr, task, bucket_cap_mb, return_params, on_step)

    task = task or CharTask(batch_size=64)
    model, ddp, opt = _setup(task, lr, bucket_cap_mb)
    state = register_ddp_hook(ddp, config, optimizer=opt) if config is not None else None
    if hook is not None:
        hook(ddp)
    losses, times = _run_steps(ddp, opt, opt.step, task, steps, lr, on_step)
    eval_loss = _eval_loss(model, task)
    traffic = state.traffic.snapshot() if state is not None else {"bytes_sent": 0, "compute_seconds": 0.0}
    return TrainResult(
        losses=losses,
        eval_loss=eval_loss,
        bytes_per_step=traffic["bytes_sent"] / steps,
        step_seconds=statistics.median(times[min(5, steps - 1) :]),
        compute_seconds_per_step=traffic["compute_seconds"] / steps,
        params=torch.cat([p.detach().reshape(-1) for p in model.parameters()]) if return_params else None,
        state=state.state_dict() if state is not None else None,
    )


def train_local_sgd(
    config: Config | Mapping[str, Any] | str,
    steps: int = 200,
    lr: float = 0.2,
    task: CharTask | None = None,
    bucket_cap_mb: float | None = None,
    return_params: bool = False,
    on_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """:func:`train_ddp`'s run (same model, data, optimizer and schedule) with Local SGD or
    CO2 from the config's ``[local_sgd]`` table: DDP keeps gradients local and the models
    are averaged at the end of each round and once more at the end (``finish``).
    ``state`` holds the averager's state plus ``periods`` (H of every round), ``rounds``
    and ``wait_seconds`` (how long each sync point was blocked by communication).
    ``step_seconds`` is the mean step time, not the median, so the averaging steps count."""

    from commpress.local_sgd import from_config

    task = task or CharTask(batch_size=64)
    model, ddp, opt = _setup(task, lr, bucket_cap_mb)
    trainer = from_config(ddp, opt, config, total_steps=steps)
    losses, times = _run_steps(ddp, opt, trainer.step, task, steps, lr, on_step)
    trainer.finish()
    eval_loss = _eval_loss(model, task)
    traffic = trainer.traffic.snapshot()
    settled = times[min(5, steps - 1) :]
    state = {
        **trainer.state_dict(),
        "periods": list(trainer.clock.periods),
        "rounds": trainer.clock.rounds,
        "wait_seconds": list(trainer.wait_seconds),
    }
    return TrainResult(
        losses=losses,
        eval_loss=eval_loss,
        bytes_per_step=traffic["bytes_sent"] / steps,
        step_seconds=sum(settled) / len(settled),  # the mean: averaging falls on one step in H
        compute_seconds_per_step=traffic["compute_seconds"] / steps,
        params=torch.cat([p.detach().reshape(-1) for p in model.parameters()]) if return_params else None,
        state=state,
    )
