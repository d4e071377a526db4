"""Replica groups (one process each) for tests/test_manager_co2.py: CO2 under a torchft
Manager, the lighthouse in the test process.

Run as ``python manager_co2_workers.py SCENARIO OUTDIR LIGHTHOUSE STORE_PORT REPLICA``:

- ``same``: for each config of :data:`CONFIGS`, CO2 over a plain gloo group
  (``init_process_group`` on STORE_PORT) and through the manager, in the same process (the
  managed run saved in mid-round, with a sync in flight, and resumed by a second trainer:
  ``resumed_run``); writes whether the models and anchors came out bit for bit equal.
- ``first``: CO2 and the slow-link config's DiLoCo (:data:`FIRST`), each through a manager
  of its own with torchft's first-step sync, each replica from another model init; writes
  which syncs committed, the models and the shared state.
- ``survivor`` / ``killed`` / ``joiner``: replica 1 dies as it starts the average of sync
  ``KILL_SYNC`` (the DiLoCo workers' helpers run the scenario's frame); replica 0 checks
  that the sync, landing a round later, left its anchor, outer state and compressor state
  as they were, syncs alone, and when the restarted replica 1 (``joiner``, another model
  init, its model not registered with the manager: the heal restarts it from the received
  anchor) has healed, both sync ``TOGETHER`` more times, finish, and write their model
  and shared state.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from manager_diloco_workers import begin, end, inner_step, kept, paced, resumed_run, snapshot
from manager_workers import make_manager, model, run

import commpress

#: the compared configs: the outer step's every setting, error feedback (Top-k), QSR's rounds
CONFIGS: dict[str, dict[str, Any]] = {
    "none": {
        "method": "none",
        "local_sgd": {
            "algorithm": "co2",
            "period": 3,
            "outer_lr": 0.7,
            "outer_momentum": 0.5,
            "staleness_penalty": 1.5,
            "clip": 0.01,
        },
    },
    "topk": {
        "method": "topk",
        "params": {"ratio": 0.3},
        "local_sgd": {"algorithm": "co2", "period": 3, "outer_lr": 0.8, "outer_momentum": 0.5},
    },
    #: 2 steps in the warm-up, then (0.02 / lr) ** 2 = 4 at AdamW's lr 0.01
    "qsr": {"method": "none", "local_sgd": {"algorithm": "co2", "period": 2, "qsr_alpha": 0.02, "warmup_steps": 4}},
}
#: the configs run from torchft's first-step sync: CO2, and the slow-link config as shipped
FIRST: dict[str, Any] = {
    "co2": CONFIGS["topk"],
    "diloco": str(Path(__file__).parents[1] / "docs" / "configs" / "slow-link.toml"),
}
STEPS = 11  # inner steps (a round in progress at the end: finish() syncs it); saved after 4


def same_runs(out: Path, lighthouse: str, port: int, replica: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=replica, world_size=2)
    manager = make_manager(replica, lighthouse, min_size=2)
    seen: dict[str, Any] = {}
    for name, cfg in CONFIGS.items():
        plain = model(0)
        opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
        reg = commpress.register(plain, cfg, optimizer=opt)
        for step in range(STEPS):
            inner_step(plain, opt, replica, step)
        reg.finish()
        managed, trainer, first, state = resumed_run(cfg, manager, name, replica, STEPS)
        seen[name] = {
            "commits": first.commits + trainer.commits,
            "penalties": [reg.local_sgd.penalties, first.penalties + trainer.penalties],
            "saved": [state["pending"] is not None, first.commits],
            "model": all(torch.equal(a, b) for a, b in zip(plain.parameters(), managed.parameters())),
            "anchor": torch.equal(reg.local_sgd.anchor, trainer.anchor),
            "changed": not torch.equal(next(model(0).parameters()), next(managed.parameters())),
            "periods": trainer.clock.periods,
        }
    (out / f"same{replica}.json").write_text(json.dumps(seen))
    manager.shutdown(wait=False)


def first_syncs(out: Path, lighthouse: str, replica: int) -> None:
    """Each config of :data:`FIRST` through a manager of its own with torchft's first-step
    sync (``init_sync=True``: replica 1 heals in sync 0), each replica from another model
    init and its model registered with the manager: which syncs committed, and the models."""
    seen: dict[str, Any] = {}
    for name, cfg in FIRST.items():
        manager = make_manager(replica, lighthouse, min_size=2, init_sync=True, name=name)
        net = model(replica)
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        manager.register_state_dict_fn("model", net.load_state_dict, net.state_dict)
        manager.register_state_dict_fn("optimizer", opt.load_state_dict, opt.state_dict)
        trainer = commpress.register(net, cfg, optimizer=opt, manager=manager).local_sgd
        for step in range(STEPS):
            inner_step(net, opt, replica, step)
        trainer.finish()
        seen[name] = trainer.commits
        torch.save({"model": net.state_dict(), "shared": trainer.shared_state_dict()}, out / f"first-{name}{replica}.pt")
        manager.shutdown(wait=False)
    (out / f"first{replica}.json").write_text(json.dumps(seen))


def failing(role: str, out: Path, lighthouse: str, port: int, replica: int) -> None:
    meet = dist.TCPStore("localhost", port, is_master=False, wait_for_workers=False)
    manager = make_manager(replica, lighthouse)
    net = model(7 if role == "joiner" else 0)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    if role != "joiner":  # CO2's heal restarts the joiner from the received anchor: its own model is not needed
        manager.register_state_dict_fn("model", net.load_state_dict, net.state_dict)
    manager.register_state_dict_fn("optimizer", opt.load_state_dict, opt.state_dict)
    trainer = commpress.register(net, CONFIGS["topk"], optimizer=opt, manager=manager).local_sgd
    begin(role, trainer, manager, meet)
    seen: dict[str, Any] = {"healed": False, "alone": 0, "participants": []}
    deadline, step = time.monotonic() + 600, 0
    while time.monotonic() < deadline:
        before = snapshot(trainer)
        syncs = len(trainer.commits)
        inner_step(net, opt, replica, step)
        step += 1
        if len(trainer.commits) == syncs:
            continue
        seen["participants"].append(trainer.backend.world_size)
        if not trainer.backend.participating:
            seen["healed"] = True
            seen["restarted"] = torch.equal(trainer.flat.read(), trainer.anchor)  # from the received anchor
        if role == "survivor" and not trainer.commits[-1] and "kept" not in seen:
            seen["kept"] = kept(before, trainer)
        if paced(seen, role == "survivor" and "kept" in seen, trainer, manager, meet):
            break
    end(role, out, seen, net, trainer, manager)


if __name__ == "__main__":
    if sys.argv[1] == "first":
        first_syncs(Path(sys.argv[2]), sys.argv[3], int(sys.argv[5]))
    else:
        run(same_runs, failing, sys.argv[1:])
