"""One FSDP training run of the demo task on an initialized process group.

Shared by ``commpress bench-fsdp`` and the FSDP tests so both train exactly the same way:
the embedding and each linear layer of :class:`CharMLP` are their own FSDP unit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commpress.hooks.fsdp2 import FSDP2State
from commpress.workloads.charlm import CharMLP, CharTask
from commpress.workloads.train import cosine_lr

__all__ = ["FSDPTrainResult", "train_fsdp"]


@dataclass
class FSDPTrainResult:
    """What one rank saw in one run."""

    losses: list[float]
    eval_loss: float
    step_seconds: float  # median wall time of a step after the first few
    traffic: dict[str, dict[str, float]]  # per side ("all_gather", "reduce_scatter"), per step
    params: torch.Tensor | None = None  # flat full (unsharded) parameters, when asked for
    state: dict[str, Any] | None = field(default=None, repr=False)


def _units(model: CharMLP) -> list[torch.nn.Module]:
    return [model.embed, model.body[0], model.body[2], model.body[4]]


def _shard_fsdp2(model: CharMLP, mesh_shape: tuple[int, ...] | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = mesh_shape or (dist.get_world_size(),)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for unit in _units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _shard_fsdp1(model: CharMLP, strategy: str) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear, torch.nn.Embedding}),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=True,
    )


def _full_params(model: torch.nn.Module, version: int) -> list[torch.Tensor]:
    if version == 2:
        return [p.full_tensor().detach().clone() for p in model.parameters()]
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


def train_fsdp(
    config: Any = None,
    steps: int = 50,
    lr: float = 0.2,
    task: CharTask | None = None,
    version: Literal[1, 2] = 2,
    mesh_shape: tuple[int, ...] | None = None,
    strategy: str = "FULL_SHARD",
    return_params: bool = False,
    hook: Callable[[torch.nn.Module], Any] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> FSDPTrainResult:
    """Train the demo model under FSDP2 (``version=2``; ``mesh_shape`` (r, s) for HSDP) or
    FSDP1 (``strategy`` a ``ShardingStrategy`` name) with ``commpress.fsdp.apply(model,
    config)`` (None: plain FSDP; ``hook(model)`` instead installs something else). SGD with
    momentum, cosine schedule; the held-out loss is measured with full-precision weights."""
    import commpress.fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    task = task or CharTask(batch_size=64)
    model = task.model()
    if version == 2:
        _shard_fsdp2(model, mesh_shape)
        wrapped: torch.nn.Module = model
    else:
        wrapped = _shard_fsdp1(model, strategy)
    state = commpress.fsdp.apply(wrapped, config) if config is not None else None
    if hook is not None:
        hook(wrapped)
    schedule = cosine_lr(lr, steps)
    opt = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    losses, times = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        x, y = task.batch(step, rank, world)
        t0 = time.perf_counter()
        loss = F.cross_entropy(wrapped(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1)
    full = _full_params(wrapped, version)
    reference = CharMLP(task.context)
    with torch.no_grad():
        for p, value in zip(reference.parameters(), full):
            p.copy_(value)
        xe, ye = task.eval_batch()
        eval_loss = F.cross_entropy(reference(xe), ye).item()
    return FSDPTrainResult(
        losses=losses,
        eval_loss=eval_loss,
        step_seconds=statistics.median(times[min(5, steps - 1) :]),
        traffic=_per_step(state, steps),
        params=torch.cat([p.reshape(-1) for p in full]) if return_params else None,
        state=state.state_dict() if state is not None else None,
    )


def _per_step(state: Any, steps: int) -> dict[str, dict[str, float]]:
    if state is None:
        return {}
    if isinstance(state, FSDP2State):
        totals = state.traffic()
    else:  # FSDP1: gradients only
        totals = {"reduce_scatter": state.traffic.snapshot()}
    return {side: {k: v / steps for k, v in snap.items()} for side, snap in totals.items()}
