"""Part ``configs``: every ready config of docs/configs through ``commpress.register`` on a
DDP model, as a GPU user runs it: one rank over NCCL (``init_process_group("nccl")``,
where a host tensor cannot travel), and 2 ranks sharing the GPU over gloo beside it; the
CPU (2 gloo ranks, and 1) as the reference.

Each config trains a few steps on GPT-2's shapes with the optimizer it is written for
(:func:`optimizer_for`) and either trains (finite losses, the ranks' weights equal) or is
refused with commpress's :class:`~commpress.errors.ConfigError`, whose message is kept in
the report; any other exception fails the check. A refusal must be the same on every
run: what the CPU accepts, CUDA must too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from commpress.bench.gpucheck.part import RUNS, Report, main, no_cuda, on_ranks

ROOT = Path(__file__).resolve().parents[3]
#: (GPT-2 scale, steps) on the GPU (False) and in a dry run (True)
SIZES = {False: (0.02, 6), True: (0.002, 3)}


def configs() -> list[Path]:
    """The ready configs, by name."""
    return sorted([*(ROOT / "docs" / "configs").glob("*.toml"), *(ROOT / "docs" / "configs").glob("*.json")])


def optimizer_for(cfg: Any) -> str:
    """The optimizer a config is written for: Muon + AdamW for ``[dion]``, SGD with momentum
    for DGC (it takes over SGD's momentum), AdamW otherwise."""
    if cfg.section("dion") is not None:
        return "muon"
    return "sgd" if cfg.params.get("dgc") else "adamw"


def _train(path: Path, rank: int, world: int, device: torch.device, scale: float, steps: int) -> dict[str, Any]:
    """One config's run on this rank: its losses and a sample of its weights, or its refusal."""
    from torch.nn.parallel import DistributedDataParallel

    from commpress.bench.optimizers import make_optimizer
    from commpress.bench.workloads import make_workload
    from commpress.config import Config
    from commpress.errors import ConfigError
    from commpress.registration import register

    cfg = Config.load(path)
    task = make_workload("gpt2", scale, batch=1)
    model = task.model().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = make_optimizer(optimizer_for(cfg), ddp.module, lr=1e-3)
    try:
        reg = register(ddp, cfg, optimizer=opt, total_steps=steps)
    except ConfigError as exc:
        return {"refused": str(exc)}
    losses = []
    for step in range(steps):
        loss = task.loss(ddp, step, rank, world)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    reg.finish()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return {"losses": losses, "sample": flat[:: max(1, flat.numel() // 1024)].tolist()}


def train_all(rank: int, world: int, device_type: str, scale: float, steps: int) -> dict[str, Any]:
    """Every config on this rank (an initialized process group); one that raises anything but
    a refusal is recorded with its error and the next one runs."""
    device = torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    out: dict[str, Any] = {}
    for path in configs():
        try:
            out[path.name] = _train(path, rank, world, device, scale, steps)
        except Exception as exc:
            out[path.name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _judge(report: Report, name: str, ranks: list[dict[str, Any]], reference: dict[str, Any] | None) -> None:
    for config in ranks[0]:
        errors = [r[config]["error"] for r in ranks if "error" in r[config]]
        refused = [r[config]["refused"] for r in ranks if "refused" in r[config]]
        trained = not errors and not refused and all(math.isfinite(x) for r in ranks for x in r[config]["losses"])
        report.check(
            f"{name}: {config} trains or is refused by a ConfigError",
            not errors and (trained or refused),
            errors=errors,
            refused=refused[:1],
        )
        if trained and len(ranks) > 1:
            same = all(r[config]["sample"] == ranks[0][config]["sample"] for r in ranks)
            report.check(f"{name}: {config} replicas hold the same weights, bit for bit", same)
        if reference is not None and not errors:
            report.check(
                f"{name}: {config} is refused where the CPU refuses it",
                bool(refused) == ("refused" in reference[config]),
                cpu=reference[config].get("refused"),
                here=refused[:1],
            )
        report.figures.setdefault("outcome", {}).setdefault(name, {})[config] = (
            "error" if errors else f"refused: {refused[0]}" if refused else "trained"
        )


def run(report: Report, dry: bool) -> None:
    scale, steps = SIZES[dry]
    reason = no_cuda(dry)
    report.figures.update({"scale": scale, "steps": steps, "configs": [p.name for p in configs()]})
    results: dict[str, list[dict[str, Any]]] = {}
    for name, (device, _, world) in RUNS.items():
        if device == "cuda" and reason is not None:
            report.skip(name, reason)
            continue
        results[name] = on_ranks(train_all, name, scale, steps)
        report.ran.append(name)
        reference = results.get(f"cpu-gloo-{world}", [None])[0] if device == "cuda" else None
        _judge(report, name, results[name], reference)


if __name__ == "__main__":
    main("configs", run)
