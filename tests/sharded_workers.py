"""Ranks of tests/test_sharded_groups.py: a model sharded with FSDP2 inside 2 replica groups
of 2 ranks (mesh (2, 2)), joined by commpress over the ``replicate`` dimension."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import commpress
from commpress.errors import ConfigError
from commpress.workloads.charlm import CharMLP, CharTask

TASK = CharTask(batch_size=16)
HIDDEN = 45  # odd: the shards of a hidden layer's rows differ in size (23 and 22)
STEPS = 12
STREAMING = {"algorithm": "diloco", "period": 4, "fragments": 2, "sync_delay": 1}  # the eager merge: its start in DCP


def _mesh() -> Any:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _model(mesh: Any, hsdp: bool = False) -> CharMLP:
    """The same initial model on every rank, sharded over mesh['shard'] (``hsdp``: over
    the 2-D mesh, FSDP2's own HSDP)."""
    torch.manual_seed(0)
    model = CharMLP(TASK.context, hidden=HIDDEN)
    where = mesh if hsdp else mesh["shard"]
    for unit in (model.embed, model.body[0], model.body[2], model.body[4]):
        fully_shard(unit, mesh=where)
    fully_shard(model, mesh=where)
    return model


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = TASK.batch(step, dist.get_rank(), dist.get_world_size())
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _full(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _build(mesh: Any, config: dict[str, Any], lr: float = 3e-3) -> tuple[Any, Any, Any]:
    model = _model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt, commpress.register(model, config, optimizer=opt, mesh=mesh, total_steps=STEPS)


def _diloco(mesh: Any, checkpoints: Path) -> dict[str, Any]:
    """Streaming DiLoCo with Top-k pseudo-gradients: straight through, and saved with DCP
    after step 6 (a fragment's average in flight) then resumed in fresh objects."""
    import torch.distributed.checkpoint as dcp

    config = {"method": "topk", "params": {"ratio": 0.1}, "local_sgd": STREAMING}
    model, opt, reg = _build(mesh, config)
    for step in range(STEPS):
        _step(model, opt, step)
    reg.finish()
    straight = _full(model)
    sent = reg.traffic.bytes_sent

    model, opt, reg = _build(mesh, config)
    for step in range(6):
        _step(model, opt, step)
    in_flight = len(reg.local_sgd._in_flight)
    dcp.save({"train": reg.stateful(model, opt)}, checkpoint_id=checkpoints)
    model, opt, reg = _build(mesh, config)
    dcp.load({"train": reg.stateful(model, opt)}, checkpoint_id=checkpoints)
    for step in range(6, STEPS):
        _step(model, opt, step)
    reg.finish()
    resharded = _load_resharded(config, checkpoints)
    try:
        reg.state_dict(full=True)
        full_refused = ""
    except ValueError as exc:
        full_refused = str(exc)
    return {
        "straight": straight,
        "resumed": _full(model),
        "in_flight": in_flight,
        "bytes": sent,
        "numel": sum(p.numel() for p in model.parameters()),
        "full_refused": full_refused,
        "resharded": resharded,
        # the outer lr that follows the replicas: sqrt(2 groups), not sqrt(4 ranks)
        "sqrt_replicas": _build(mesh, {"local_sgd": {**STREAMING, "outer_lr": "sqrt_replicas"}})[2].local_sgd.outer_lr,
    }


def _load_resharded(config: dict[str, Any], checkpoints: Path) -> str:
    """The 2 x 2 checkpoint loaded into 1 group of 4 shards: the model reshards (DCP does),
    commpress's state of another group count and shard is refused."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard"))
    model, opt, reg = _build(mesh, config)
    try:
        dcp.load({"train": reg.stateful(model, opt)}, checkpoint_id=checkpoints)
    except Exception as exc:  # DCP wraps a rank's error in its own
        return str(exc)
    return ""


def _period_one(mesh: Any) -> dict[str, Any]:
    """Local SGD with period 1 and no compression over the groups, and FSDP2's own HSDP,
    both with plain SGD; and the cross-group hook (method none, then Top-k) against HSDP."""
    runs: dict[str, Any] = {}
    for name, config in (
        ("local_sgd", {"local_sgd": {"algorithm": "local_sgd", "period": 1}}),
        ("hook_none", {}),
        ("hook_topk", {"method": "topk", "params": {"ratio": 0.2}}),
        ("hsdp", None),
    ):
        model = _model(mesh, hsdp=config is None)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        reg = commpress.register(model, config, optimizer=opt, mesh=mesh) if config is not None else None
        losses = [_step(model, opt, step) for step in range(8)]
        runs[name] = {"params": _full(model), "losses": losses}
        if reg is not None:
            runs[name]["kind"] = repr(reg)
    return runs


def _non_finite(mesh: Any) -> str:
    """Rank 0's shard turns inf before the first sync: its shard's group raises, and so
    does every rank of its replica group's shards (a loud stop, not a hang)."""
    model, opt, _ = _build(mesh, {"local_sgd": {"algorithm": "diloco", "period": 2}})
    _step(model, opt, 0)
    if dist.get_rank() == 0:
        with torch.no_grad():
            next(model.parameters()).to_local().fill_(float("inf"))
    try:
        _step(model, opt, 1)
    except FloatingPointError as exc:
        return str(exc)
    return ""


def _refusals(mesh: Any) -> dict[str, str]:
    """Clear errors: a 1-D mesh, a model sharded over the 2-D mesh, [fsdp] with mesh=."""
    out = {}
    cases = {
        "one_dim": lambda: commpress.register(_model(mesh), {}, mesh=mesh["shard"]),
        "hsdp_model": lambda: commpress.register(_model(mesh, hsdp=True), {}, mesh=mesh),
        "fsdp_table": lambda: commpress.register(_model(mesh), {"fsdp": {}}, mesh=mesh),
    }
    for name, call in cases.items():
        try:
            call()
            out[name] = ""
        except ConfigError as exc:
            out[name] = str(exc)
    return out


def run(rank: int, world: int, checkpoints: str) -> dict[str, Any]:
    mesh = _mesh()
    return {
        "diloco": _diloco(mesh, Path(checkpoints)),
        "period_one": _period_one(mesh),
        "non_finite": _non_finite(mesh),
        "refusals": _refusals(mesh),
    }
