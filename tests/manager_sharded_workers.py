"""Ranks of tests/test_manager_sharded.py: Streaming DiLoCo between 2 replica groups of a
model sharded with FSDP2 over 2 ranks each, every rank syncing its shard through a torchft
Manager of its own (group rank = shard), the lighthouse in the test process.

- ``same`` (:func:`same_runs`, 4 ranks of one job, mesh (2, 2)): for Streaming DiLoCo and
  CO2 (:data:`SAME`), the plain sharded run (``register(..., mesh=)``) and the run through
  the managers, in the same processes; each rank's shard of the model and the anchor come
  out bit for bit equal. Then an inf in one rank's shard (:func:`non_finite`).
- ``survivor`` / ``killed`` / ``joiner`` (``python manager_sharded_workers.py ROLE OUTDIR
  LIGHTHOUSE STORE_PORT RANK``, ranks 0-1 the survivor group, 2-3 the other; each group a
  job of its own): in sync :data:`KILL_SYNC` the killed group's rank 0 exits as it starts
  the average, its rank 1 once its average is there, so the survivor group's rank 1 holds
  its average and rank 0 a failure (the group's vote stops both); each survivor rank checks
  that the sync left its anchor, outer state
  and compressor state as they were, syncs alone, and when the restarted group (another
  model init) has healed, both groups sync
  ``manager_diloco_workers.TOGETHER`` more times, finish and write
  each rank's shard of the model and shared state.

The processes meet through a TCPStore the test process holds (STORE_PORT).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from manager_diloco_workers import kept, paced, snapshot
from manager_workers import meet_up
from sharded_workers import TASK, _model
from torch.distributed.device_mesh import init_device_mesh
from torchft import Manager, ProcessGroupGloo

import commpress
from commpress.config import Config
from commpress.errors import ConfigError
from commpress.local_sgd import from_config

#: the slow-link kind of Streaming DiLoCo: TernGrad entropy-coded, the eager merge, sqrt(M)
CONFIG = {
    "method": "terngrad",
    "params": {"entropy": True},
    "local_sgd": {"algorithm": "diloco", "period": 4, "fragments": 2, "sync_delay": 1, "outer_lr": "sqrt_replicas"},
}
#: CO2 (its one-round-stale average) with Top-k pseudo-gradients
CO2 = {"method": "topk", "params": {"ratio": 0.3}, "local_sgd": {"algorithm": "co2", "period": 2}}
SAME = {"streaming": CONFIG, "co2": CO2}
#: the kill scenario's: a sync lands in the step it starts, so the killed group's shard 1
#: exits between the two (its average done) without a collective of FSDP's in between
KILLED = {**CONFIG, "local_sgd": {**CONFIG["local_sgd"], "sync_delay": 0}}
STEPS = 10
KILL_SYNC = 3


def manager(shard: int, group: str, lighthouse: str, store: dist.TCPStore) -> Manager:
    """The manager of one rank of a replica group (group rank = its shard); without
    torchft's first-step sync, as the plain run and the other kill tests start."""
    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        replica_id=group,
        lighthouse_addr=lighthouse,
        rank=shard,
        world_size=2,
        store_addr="localhost",
        store_port=store.port,
        timeout=timedelta(seconds=30),
        init_sync=False,
    )


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, index: int) -> None:
    x, y = TASK.batch(index, rank, 4)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def shards(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def same_runs(rank: int, world: int, lighthouse: str) -> dict[str, Any]:
    """Each config of :data:`SAME` plain (``mesh=``) and through this rank's manager."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    group, shard = divmod(rank, 2)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False) if shard == 0 else None
    port = torch.tensor([store.port if store else 0])
    dist.broadcast(port, src=2 * group, group=mesh["shard"].get_group())  # the group's store, from its rank 0
    store = store or dist.TCPStore("localhost", int(port), is_master=False, wait_for_workers=False)
    ft = manager(shard, f"group_{group}", lighthouse, store)
    result: dict[str, Any] = {"refused": refusals(mesh, ft)}
    for name, config in SAME.items():
        runs = []
        for managed in (False, True):
            model = _model(mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            if managed:  # as register(..., manager=ft) builds it, under a key of its own per config
                trainer = from_config(model, opt, Config.load(config), manager=ft, key=name)
                trainer.register_optimizer_hooks()
            else:
                trainer = commpress.register(model, config, optimizer=opt, mesh=mesh).local_sgd
            for index in range(STEPS):
                step(model, opt, rank, index)
            trainer.finish()
            runs.append((shards(model), trainer.anchor.clone(), trainer))
        (plain, plain_anchor, _), (through, anchor, trainer) = runs
        result[name] = {
            "commits": trainer.commits,
            "lr": trainer.outer_lr,
            "sharded": trainer.flat.shard_group is not None,
            "model": all(torch.equal(a, b) for a, b in zip(plain, through)),
            "anchor": torch.equal(plain_anchor, anchor),
            "changed": not torch.equal(shards(_model(mesh))[0], through[0]),
        }
    result["non_finite"] = non_finite(mesh, ft, rank)
    ft.shutdown(wait=False)
    return result


def non_finite(mesh: Any, ft: Manager, rank: int) -> list[bool]:
    """Rank 0 sends an inf in its shard's first sync: on every rank the sync is not
    committed, the anchor is as it was and the local values went back to it (the inf is
    in shard 0's average only: the group's vote stops shard 1 too)."""
    model = _model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = {"method": "none", "local_sgd": {"algorithm": "diloco", "period": 2}}
    trainer = from_config(model, opt, Config.load(config), manager=ft, key="non_finite")
    trainer.register_optimizer_hooks()
    anchor = trainer.anchor.clone()
    start = trainer.averager.start

    def poisoned(bucket: Any, *args: Any, **kwargs: Any) -> Any:
        if rank == 0:
            bucket.buffer[0] = float("inf")
        return start(bucket, *args, **kwargs)

    trainer.averager.start = poisoned
    for index in (0, 1):  # the sync lands in step 1
        step(model, opt, rank, index)
    return [trainer.commits == [False], torch.equal(trainer.anchor, anchor), torch.equal(trainer.flat.read(), anchor)]


def refusals(mesh: Any, ft: Manager) -> list[str]:
    """What a sharded model under a manager is refused with: a config without
    ``[local_sgd]``, and ``mesh=`` beside the manager."""
    out = []
    for config, mesh_given in (({"method": "topk"}, None), (CONFIG, mesh)):
        model = _model(mesh)
        try:
            commpress.register(model, config, optimizer=torch.optim.AdamW(model.parameters()), manager=ft, mesh=mesh_given)
            out.append("")
        except ConfigError as exc:
            out.append(str(exc))
    return out


def failing(role: str, out: Path, lighthouse: str, port: int, rank: int) -> None:
    """One rank of a group in the kill scenario (module docstring)."""
    group, shard = divmod(rank, 2)
    meet = dist.TCPStore("localhost", port, is_master=False, wait_for_workers=False)
    store = _group_store(role, group, shard, meet)
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=shard, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    model = _model({"shard": mesh})  # what _model reads of a mesh: the dimension it shards over
    if role == "joiner":  # another init: what it ends with comes from its peer
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ft = manager(shard, f"group_{group}", lighthouse, store)
    ft.register_state_dict_fn("model", lambda s: _load_shards(model, s), lambda: {"shards": shards(model)})
    ft.register_state_dict_fn("optimizer", opt.load_state_dict, opt.state_dict)
    trainer = commpress.register(model, KILLED, optimizer=opt, manager=ft).local_sgd
    if role == "killed":
        _dies(trainer, ft, shard, meet)
    meet_up(role, meet, processes=4)
    seen: dict[str, Any] = {"healed": False, "alone": 0, "participants": []}
    deadline, index = time.monotonic() + 600, 0
    while time.monotonic() < deadline:
        before = snapshot(trainer)
        syncs = len(trainer.commits)
        step(model, opt, rank, index)
        index += 1
        if len(trainer.commits) == syncs:
            continue
        seen["participants"].append(trainer.backend.world_size)
        seen["healed"] |= not trainer.backend.participating
        if role == "survivor" and not trainer.commits[-1] and "kept" not in seen:
            seen["kept"] = kept(before, trainer)
            seen["error"] = str(ft.errored().original_exception)  # what the manager was told
        # a group's ranks share its manager steps: either may set the stop, both read the same
        if paced(seen, role == "survivor" and "kept" in seen, trainer, ft, meet):
            break
    trainer.finish()
    seen["step"], seen["commits"] = ft.current_step(), trainer.commits
    torch.save({"model": shards(model), "shared": trainer.shared_state_dict()}, out / f"{role}{rank}.pt")
    (out / f"{role}{rank}.json").write_text(json.dumps(seen))
    ft.shutdown(wait=False)


def _dies(trainer: Any, ft: Manager, shard: int, meet: dist.TCPStore) -> None:
    """In sync :data:`KILL_SYNC` rank 0 exits as it starts the average (once rank 1 holds the
    sync's quorum: rank 0 serves the group's quorum), rank 1 once its average is there."""
    start, wait = trainer.averager.start, trainer._wait

    def starting(*args: Any, **kwargs: Any) -> Any:
        if ft.current_step() == KILL_SYNC:
            if shard == 0:
                meet.wait(["quorate"])
                os._exit(0)
            meet.set("quorate", "1")
        return start(*args, **kwargs)

    def waiting(average: Any) -> Any:
        if ft.current_step() == KILL_SYNC:
            average.future.wait()
            os._exit(0)
        return wait(average)

    trainer.averager.start = starting
    if shard == 1:
        trainer._wait = waiting


def _load_shards(model: torch.nn.Module, state: dict[str, Any]) -> None:
    with torch.no_grad():
        for p, value in zip(model.parameters(), state["shards"]):
            p.to_local().copy_(value)


def _group_store(role: str, group: int, shard: int, meet: dist.TCPStore) -> dist.TCPStore:
    """The replica group's store: held by its rank 0, found by its rank 1 through ``meet``."""
    key = f"{role}-group{group}"
    if shard == 0:
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        meet.set(key, str(store.port))
        return store
    meet.wait([key])
    return dist.TCPStore("localhost", int(meet.get(key)), is_master=False, wait_for_workers=False)


if __name__ == "__main__":
    role, outdir, lighthouse, port, rank = sys.argv[1:6]
    failing(role, Path(outdir), lighthouse, int(port), int(rank))
