"""One FSDP training run of the demo task on an initialized process group.

Shared by ``commpress bench-fsdp`` and the FSDP tests so both train exactly the same way:
the embedding and each linear layer of :class:`CharMLP` are their own FSDP unit.
"""

from __future__ import annotations

import copy
import io
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commpress.fsdp
from commpress.fsdp.fsdp2 import FSDP2State
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


def _shard_fsdp2(
    model: CharMLP, mesh_shape: tuple[int, ...] | None, mixed_precision: torch.dtype | None, device: torch.device
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shape = mesh_shape or (dist.get_world_size(),)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    policy = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=mixed_precision)
    for unit in _units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


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


def _through_file(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` written with ``torch.save`` and read back as plain data only."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def train_fsdp(
    config: Any = None,
    steps: int = 50,
    lr: float = 0.2,
    task: CharTask | None = None,
    version: Literal[1, 2] = 2,
    mesh_shape: tuple[int, ...] | None = None,
    strategy: str = "FULL_SHARD",
    hidden: int = 512,
    restart_at: int | None = None,
    return_params: bool = False,
    hook: Callable[[torch.nn.Module], Any] | None = None,
    on_step: Callable[[int], None] | None = None,
    mixed_precision: torch.dtype | None = None,
    device: str = "cpu",
) -> FSDPTrainResult:
    """Train the demo model under FSDP2 (``version=2``; ``mesh_shape`` (r, s) for HSDP) or
    FSDP1 (``strategy`` a ``ShardingStrategy`` name) with ``commpress.fsdp.apply(model,
    config)`` (None: plain FSDP; ``hook(model)`` instead installs something else). ``hidden``
    sizes the model's hidden layers. ``mixed_precision`` (FSDP2): FSDP2's own
    ``MixedPrecisionPolicy`` with that ``param_dtype`` and ``reduce_dtype`` (e.g.
    ``torch.bfloat16``: weights gathered and computed with, gradients reduced in bf16; the
    master shards and the optimizer stay float32). ``device`` (FSDP2): where the model and the
    batches live (``"cuda"``: this process's current GPU). SGD with momentum, cosine schedule; the
    held-out loss is measured with full-precision weights. ``restart_at`` (FSDP2): at that step, save
    model, optimizer and commpress state (the whole job's, as a rank-0 checkpoint holds it,
    through ``torch.save`` and ``torch.load(weights_only=True)``), rebuild everything fresh
    and load them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    task = task or CharTask(batch_size=64)
    if restart_at is not None and version != 2:
        raise ValueError("restart_at is supported with FSDP2 (version=2) only")
    if mixed_precision is not None and version != 2:
        raise ValueError("mixed_precision is supported with FSDP2 (version=2) only")
    if device != "cpu" and version != 2:
        raise ValueError(f"device = {device!r} is supported with FSDP2 (version=2) only; FSDP1 runs on the CPU here")
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())

    def build() -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
        torch.manual_seed(task.seed)
        model = CharMLP(task.context, hidden=hidden).to(where)
        if version == 2:
            _shard_fsdp2(model, mesh_shape, mixed_precision, where)
        else:
            model = _shard_fsdp1(model, strategy)
        state = commpress.fsdp.apply(model, config) if config is not None else None
        if hook is not None:
            hook(model)
        return model, state, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    wrapped, state, opt = build()
    schedule = cosine_lr(lr, steps)
    losses, times, spent = [], [], {}
    for step in range(steps):
        if step == restart_at:
            saved = copy.deepcopy(
                (wrapped.state_dict(), opt.state_dict(), _through_file(state.state_dict(full=True)) if state else None)
            )
            spent = _totals(state)
            wrapped, state, opt = build()
            wrapped.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            if state is not None:
                state.load_state_dict(saved[2])
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        x, y = (t.to(where) for t in task.batch(step, rank, world))
        t0 = time.perf_counter()
        loss = F.cross_entropy(wrapped(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # waits for the step on a GPU
        times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(step + 1)
    full = [p.cpu() for p in _full_params(wrapped, version)]
    reference = CharMLP(task.context, hidden=hidden)
    with torch.no_grad():
        for p, value in zip(reference.parameters(), full):
            p.copy_(value)
        xe, ye = task.eval_batch()
        eval_loss = F.cross_entropy(reference(xe), ye).item()
    traffic = _totals(state)
    for side, counters in spent.items():
        for key, value in counters.items():
            traffic[side][key] += value
    return FSDPTrainResult(
        losses=losses,
        eval_loss=eval_loss,
        step_seconds=statistics.median(times[min(5, steps - 1) :]),
        traffic={side: {k: v / steps for k, v in c.items()} for side, c in traffic.items()},
        params=torch.cat([p.reshape(-1) for p in full]) if return_params else None,
        state=state.state_dict() if state is not None else None,
    )


def _totals(state: Any) -> dict[str, dict[str, float]]:
    """Cumulative traffic of a commpress FSDP state, per side."""
    if state is None:
        return {}
    if isinstance(state, FSDP2State):
        return state.traffic()
    return {"reduce_scatter": dict(state.traffic.snapshot())}  # FSDP1: gradients only
