"""Replica groups (one process each) for tests/test_manager.py: commpress under a torchft
Manager, the lighthouse in the test process.

Run as ``python manager_workers.py SCENARIO OUTDIR LIGHTHOUSE STORE_PORT REPLICA``:

- ``same``: every method trained through the manager and, in the same process, through a
  plain gloo group (``init_process_group`` on STORE_PORT); writes whether the models and
  commpress states came out bit for bit equal.
- ``layerwise``: as ``same`` for the layer-wise plans of :data:`LAYERWISE` (plans switch
  tensors between settings, moving their state); writes the plans too.
- ``survivor-W`` / ``killed-W`` / ``joiner-W`` (W: ``hook``, the DDP hook of :data:`FAILING`;
  ``layerwise``, a plan every step (:data:`PLAN_EVERY_STEP`), so the killed step and the
  step the joiner heals in both plan; ``planned``, one plan at step 1 (:data:`PLAN_ONCE`),
  handed to the joiner; ``adam``, 1-bit Adam of :data:`ONEBIT_ADAM`,
  killed past its warm-up; or ``dion``, Dion of :data:`DION`): replica 0
  trains; replica 1 dies inside its
  backward pass at :data:`KILL_STEP` (after some buckets were reduced); replica 0 checks
  that step left its model and commpress state as they were, trains alone, and when the
  restarted replica 1 (``joiner``, another model init, started by the test once replica 0 has
  trained alone, joining at once) has healed, both train
  :data:`TOGETHER` more steps and write their model and shared commpress state.
- ``adam``: 1-bit Adam (a warm-up step, then momenta in signs) through the manager and
  through a plain gloo group, as ``same``; then through a manager of its own with the
  first-step sync, each replica from another model init.
- ``dion``: Dion of :data:`DION` (Muon + AdamW) through the manager and through a plain gloo
  group, as ``adam``.
- ``first``: every method (and a layer-wise plan every step) through a manager of its own with torchft's first-step sync
  (``init_sync=True``: in step 0 every replica but one heals, though it counts among the
  participants), each replica from another model init; writes which steps committed and
  the models.

The processes meet through a TCPStore the test process holds (STORE_PORT), never through
the group that breaks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchft import Manager, ProcessGroupGloo

from commpress.compressors import available
from commpress.hooks import CommState, ddp_hook, managed_ddp, register_ddp_hook

#: method parameters that make every method compress the small test layers
PARAMS: dict[str, dict[str, Any]] = {
    "powersgd": {"rank": 2, "min_compression_rate": 0.0},
    "acpsgd": {"rank": 2, "min_compression_rate": 0.0},
    "topk": {"ratio": 0.3},
    "terngrad": {"entropy": True},  # two collectives a bucket, sizes from a maximum: the slow-link config's codes
}
STEPS = 3
KILL_STEP = 2
TOGETHER = 3
#: the config of the failure scenario: low rank with an all-gather method on one layer
FAILING = {
    "method": "powersgd",
    "params": PARAMS["powersgd"],
    "overrides": [{"params": ["2.*"], "method": "topk", "method_params": {"ratio": 0.3}}],
}
BUCKET_MB = 0.001  # about one parameter per bucket: several buckets, several rounds in flight
#: layer-wise plans (measured at steps 0, 2, 4, planned at 1, 3, 5) and the steps to run them
LAYERWISE = {
    "topk": {"method": "topk", "params": {"ratio": 0.1, "min_numel": 0}, "layerwise": {"enabled": True, "every": 2}},
    "powersgd": {"method": "powersgd", "params": PARAMS["powersgd"], "layerwise": {"enabled": True, "every": 2}},
}
LAYERWISE_STEPS = 6
PLAN_EVERY_STEP = {**LAYERWISE["topk"], "layerwise": {"enabled": True, "every": 1}}
#: one plan, at step 1: a replica that heals later is handed it (its buckets follow it)
PLAN_ONCE = {**LAYERWISE["topk"], "layerwise": {"enabled": True, "every": 1000}}


def model(seed: int, hidden: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 8))


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


#: the replica group's stores (the quorum's group is set up through them: keep them alive)
STORES: list[dist.TCPStore] = []


def make_manager(replica: int, lighthouse: str, min_size: int = 1, init_sync: bool = False, name: str = "replica") -> Manager:
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    STORES.append(store)
    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_size,
        replica_id=f"{name}_{replica}",
        lighthouse_addr=lighthouse,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        timeout=timedelta(seconds=30),
        init_sync=init_sync,
    )


def step_plain(ddp: nn.Module, opt: torch.optim.Optimizer, replica: int, step: int) -> None:
    x, y = batch(replica, step)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    opt.zero_grad()


def step_managed(ddp: nn.Module, opt: torch.optim.Optimizer, manager: Manager, replica: int, step: int) -> bool:
    """One step as torchft's examples have it; whether the manager committed it."""
    manager.start_quorum()
    x, y = batch(replica, step)
    nn.functional.mse_loss(ddp(x), y).backward()
    committed = manager.should_commit()
    if committed:
        opt.step()
    opt.zero_grad()
    return committed


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in flat(value, f"{prefix}{key}/").items()}
    return {prefix: state}


def same(a: Any, b: Any) -> bool:
    fa, fb = flat(a), flat(b)
    return fa.keys() == fb.keys() and all(
        torch.equal(x, fb[k]) if isinstance(x, torch.Tensor) else x == fb[k] for k, x in fa.items()
    )


def compared(state: dict[str, Any]) -> dict[str, Any]:
    """What two runs must agree on: the compressors' state and the step (not who saved it)."""
    return {"compressors": state["compressors"], "step": state["step"]}


def same_runs(out: Path, lighthouse: str, port: int, replica: int, layerwise: bool = False) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=replica, world_size=2)
    manager = make_manager(replica, lighthouse, min_size=2)
    seen: dict[str, Any] = {}
    configs = LAYERWISE if layerwise else {m: {"method": m, "params": PARAMS.get(m, {})} for m in available()}
    steps = LAYERWISE_STEPS if layerwise else STEPS
    for method in os.environ.get("METHODS", " ".join(configs)).split():
        cfg = configs[method]
        plain = DistributedDataParallel(model(0), find_unused_parameters=True, bucket_cap_mb=BUCKET_MB)
        state = CommState(cfg, model=plain.module)
        plain.register_comm_hook(state, ddp_hook)
        opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        for step in range(steps):
            step_plain(plain, opt, replica, step)
        managed = managed_ddp(model(0), bucket_cap_mb=BUCKET_MB)
        mstate = CommState(cfg, managed.module, manager=manager, key=method)
        managed.register_comm_hook(mstate, ddp_hook)
        mopt = torch.optim.SGD(managed.parameters(), lr=0.1)
        committed = [step_managed(managed, mopt, manager, replica, step) for step in range(steps)]
        seen[method] = {
            "committed": all(committed),
            "participants": manager.num_participants(),
            "model": all(torch.equal(a, b) for a, b in zip(plain.module.parameters(), managed.module.parameters())),
            "state": same(compared(state.state_dict()), compared(mstate.state_dict())),
            "changed": not torch.equal(next(model(0).parameters()), next(managed.module.parameters())),
        }
        if layerwise:
            seen[method]["plans"] = [state.plan.to_dict(), mstate.plan.to_dict()]
    (out / f"{'layerwise' if layerwise else 'same'}{replica}.json").write_text(json.dumps(seen))
    manager.shutdown(wait=False)


def layerwise_runs(out: Path, lighthouse: str, port: int, replica: int) -> None:
    """``same`` for the configs of :data:`LAYERWISE`."""
    same_runs(out, lighthouse, port, replica, layerwise=True)


#: 1-bit Adam: one exact step, then the momentum in signs (per tensor, every tensor)
ONEBIT_ADAM = {"method": "onebit", "params": {"min_numel": 0}, "onebit_adam": {"warmup": 1}}


def adamw_optimizer(net: nn.Module) -> Any:
    return torch.optim.AdamW(net.parameters(), lr=0.01)


#: Dion at rank 2 on the two weight matrices (Muon's), the biases (AdamW's) through Top-k
DION = {"method": "topk", "params": {"ratio": 0.3, "min_numel": 0}, "dion": {"rank": 2}}


def dion_optimizer(net: nn.Module) -> Any:
    from commpress.optim import HybridOptimizer

    weights = [p for p in net.parameters() if p.ndim == 2]
    biases = [p for p in net.parameters() if p.ndim != 2]
    return HybridOptimizer([torch.optim.Muon(weights, lr=0.02), torch.optim.AdamW(biases, lr=0.01)])


def takeover_runs(out: Path, lighthouse: str, port: int, replica: int, name: str) -> None:
    """A method that takes over the optimizer's step (``adam``: [onebit_adam] on AdamW;
    ``dion``: [dion] on Muon + AdamW) on a plain gloo group, then under a Manager from the same
    init and from another init (torchft's first-step sync heals replica 1)."""
    import commpress

    config, make_optimizer = {"adam": (ONEBIT_ADAM, adamw_optimizer), "dion": (DION, dion_optimizer)}[name]
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=replica, world_size=2)
    plain = DistributedDataParallel(model(0), bucket_cap_mb=BUCKET_MB)
    opt = make_optimizer(plain)
    commpress.register(plain, config, optimizer=opt)
    for step in range(STEPS):
        step_plain(plain, opt, replica, step)
    seen: dict[str, Any] = {}
    for run, init_sync in (("same", False), ("first", True)):
        manager = make_manager(replica, lighthouse, min_size=2, init_sync=init_sync, name=f"{name}_{run}")
        net = managed_ddp(model(0 if run == "same" else replica), bucket_cap_mb=BUCKET_MB)
        inner = make_optimizer(net)
        manager.register_state_dict_fn("model", net.module.load_state_dict, net.module.state_dict)
        manager.register_state_dict_fn("optimizer", inner.load_state_dict, inner.state_dict)
        reg = commpress.register(net, config, optimizer=inner, manager=manager)
        seen[run] = {
            "committed": [step_managed(net, inner, manager, replica, step) for step in range(STEPS)],
            "plain": all(torch.equal(a, b) for a, b in zip(plain.module.parameters(), net.module.parameters())),
            "sent": reg.traffic.bytes_sent,
        }
        saved: dict[str, Any] = {"model": net.module.state_dict()}
        if name == "dion":
            seen[run]["steps"] = reg.dion.steps
            saved["shared"] = reg.dion.iteration.comm.shared_state_dict()
        torch.save(saved, out / f"{name}-{run}{replica}.pt")
        manager.shutdown(wait=False)
    (out / f"{name}{replica}.json").write_text(json.dumps(seen))


def first_steps(out: Path, lighthouse: str, replica: int) -> None:
    seen: dict[str, Any] = {}
    configs: dict[str, Any] = {m: {"method": m, "params": PARAMS.get(m, {})} for m in available()}
    configs["layerwise"] = PLAN_EVERY_STEP  # replica 1 heals in step 0, measured; every replica plans at step 1
    for method in os.environ.get("METHODS", " ".join(configs)).split():
        manager = make_manager(replica, lighthouse, min_size=2, init_sync=True, name=method.replace("-", "_"))
        net = managed_ddp(model(replica), bucket_cap_mb=BUCKET_MB)
        manager.register_state_dict_fn("model", net.module.load_state_dict, net.module.state_dict)
        state = CommState(configs[method], net.module, manager=manager, key=method)
        net.register_comm_hook(state, ddp_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        seen[method] = [step_managed(net, opt, manager, replica, step) for step in range(STEPS)]
        torch.save(net.module.state_dict(), out / f"first-{method}{replica}.pt")
        manager.shutdown(wait=False)
    (out / f"first{replica}.json").write_text(json.dumps(seen))


def meet_up(role: str, meet: dist.TCPStore, processes: int = 2) -> None:
    """The first ``processes`` (two replicas, or the ranks of two replica groups) start
    together; the restarted one (``joiner``) joins at once: the test starts it once the
    survivor has trained alone (``alone`` in ``meet``: tests/test_manager.py's ``_when_alone``)."""
    if role == "joiner":
        assert meet.check(["alone"]), "the restarted replica was started before its peer trained alone"
        return
    meet.add("ready", 1)
    while int(meet.add("ready", 0)) < processes:
        time.sleep(0.05)


def failing(scenario: str, out: Path, lighthouse: str, port: int, replica: int) -> None:
    import commpress

    scenario, _, what = scenario.partition("-")  # what: "hook", "layerwise", "planned", "adam" (ONEBIT_ADAM), "dion"
    meet = dist.TCPStore("localhost", port, is_master=False, wait_for_workers=False)
    manager = make_manager(replica, lighthouse)
    net = managed_ddp(model(7 if scenario == "joiner" else 0), bucket_cap_mb=BUCKET_MB)
    manager.register_state_dict_fn("model", net.module.load_state_dict, net.module.state_dict)
    if what in ("adam", "dion"):
        opt = adamw_optimizer(net) if what == "adam" else dion_optimizer(net)
        manager.register_state_dict_fn("optimizer", opt.load_state_dict, opt.state_dict)
        reg = commpress.register(net, ONEBIT_ADAM if what == "adam" else DION, optimizer=opt, manager=manager)
        state = reg.onebit_adam.average.comm if what == "adam" else reg.dion.iteration.comm
    else:
        cfg = {"layerwise": PLAN_EVERY_STEP, "planned": PLAN_ONCE}.get(what, FAILING)
        state = register_ddp_hook(net, cfg, manager=manager)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
    meet_up(scenario, meet)
    if scenario == "killed":
        first = net.module[0].weight  # its gradient comes last in the backward pass: later buckets were reduced
        first.register_hook(lambda g: os._exit(0) if manager.current_step() == KILL_STEP else g)
    seen: dict[str, Any] = {"healed": False, "alone": 0}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        step = manager.current_step()
        if meet.check(["stop"]) and step >= int(meet.get("stop")):
            break
        before = (
            [p.detach().clone() for p in net.parameters()],
            state.state_dict(),
        )
        committed = step_managed(net, opt, manager, replica, step)
        seen.setdefault("participants", []).append(manager.num_participants())
        seen.setdefault("commits", []).append(committed)
        if not manager.is_participating():
            seen["healed"] = True
        if scenario == "survivor" and step == KILL_STEP and "failed_step_committed" not in seen:
            seen["failed_step_committed"] = committed
            seen["model_kept"] = all(torch.equal(a, b) for a, b in zip(before[0], net.parameters()))
            seen["state_kept"] = same(before[1], state.state_dict())
        if scenario == "survivor" and "failed_step_committed" in seen and committed:
            if manager.num_participants() == 1:
                seen["alone"] += 1
                meet.set("alone", "1")  # the test starts the restarted replica now
                time.sleep(0.2)  # pace the steps alone while the restarted replica starts
            elif not meet.check(["stop"]):
                meet.set("stop", str(manager.current_step() - 1 + TOGETHER))
    seen["step"] = manager.current_step()
    torch.save({"model": net.module.state_dict(), "shared": state.shared_state_dict()}, out / f"{scenario}-{what}.pt")
    (out / f"{scenario}-{what}.json").write_text(json.dumps(seen))
    manager.shutdown(wait=False)


def run(same_runs: Callable[..., None], failing: Callable[..., None], argv: list[str]) -> None:
    """A worker's entry: ``SCENARIO OUTDIR LIGHTHOUSE STORE_PORT REPLICA`` (``same``, ``first``,
    ``adam`` or a failure scenario)."""
    scenario, outdir, lighthouse, port, replica = argv[:5]
    if scenario == "first":
        first_steps(Path(outdir), lighthouse, int(replica))
    elif scenario in ("adam", "dion"):
        takeover_runs(Path(outdir), lighthouse, int(port), int(replica), scenario)
    elif scenario == "same":
        same_runs(Path(outdir), lighthouse, int(port), int(replica))
    elif scenario == "layerwise":
        layerwise_runs(Path(outdir), lighthouse, int(port), int(replica))
    else:
        failing(scenario, Path(outdir), lighthouse, int(port), int(replica))


if __name__ == "__main__":
    run(same_runs, failing, sys.argv[1:])
