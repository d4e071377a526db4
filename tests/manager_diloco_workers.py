"""Replica groups (one process each) for tests/test_manager_diloco.py: Streaming DiLoCo
under a torchft Manager, the lighthouse in the test process.

Run as ``python manager_diloco_workers.py SCENARIO OUTDIR LIGHTHOUSE STORE_PORT REPLICA``:

- ``same``: for each method of :data:`METHODS`, DiLoCo over a plain gloo group
  (``init_process_group`` on STORE_PORT) and through the manager, in the same process, and
  Local SGD with QSR's rounds likewise (:data:`LOCAL_SGD`), and the shipped config that
  averages every step, landing a step later (:data:`H1`); the managed run saves its
  ``state_dict()`` at :data:`SAVE_STEP` and loads it back; writes whether the models and
  anchors came out bit for bit equal.
- ``survivor-M`` / ``killed-M`` / ``joiner-M`` (M: ``topk`` or ``terngrad``, entropy-coded):
  replica 1 dies inside the average of sync
  :data:`KILL_SYNC`; replica 0 checks that the sync left its anchor, outer state and
  compressor state as they were and the fragment with the step's values, as if the sync had
  not run (not the anchor's), syncs alone, and
  when the restarted replica 1 (``joiner``, another model init) has healed, both sync
  :data:`TOGETHER` more times, finish, and write their model, anchor and shared state.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from manager_workers import batch, make_manager, meet_up, model, run, same
from torch import nn

import commpress
from commpress.comm.manager_backend import ManagerBackend
from commpress.compressors import AllGather, Collective, terngrad
from commpress.compressors.wire import entropy
from commpress.compressors.wire.collectives import relayed
from commpress.config import Config
from commpress.kernels.cpu import ternary as ternary_kernels
from commpress.kernels.cpu import topk as topk_kernels
from commpress.local_sgd import from_config
from commpress.local_sgd.flat import FlatModel

#: the methods compared with the plain run, and their parameters
METHODS: dict[str, dict[str, Any]] = {"none": {}, "terngrad": {"entropy": True}, "topk": {"ratio": 0.3}}
#: Local SGD, which runs under the manager as DiLoCo with the plain average as outer step,
#: with QSR's rounds (2 steps in the warm-up, then (0.02 / lr) ** 2 = 4 at AdamW's lr 0.01)
LOCAL_SGD = {
    "method": "none",
    "local_sgd": {"algorithm": "local_sgd", "period": 2, "qsr_alpha": 0.02, "warmup_steps": 4},
}
#: the shipped config that averages every step, each average landing a step later
H1 = str(Path(__file__).resolve().parents[1] / "docs" / "configs" / "slow-link-h1.toml")
STEPS = 9  # inner steps of the comparison (a round in progress at the end: finish() syncs it)
SAVE_STEP = 4  # the managed run's state_dict(): DiLoCo's sync started at step 4 in flight
KILL_SYNC = 3
#: the methods of the failure runs: Top-k, TernGrad entropy-coded, and PowerSGD, whose warm
#: starts are shared state a healed replica must stage as its peers do
KILLED: dict[str, dict[str, Any]] = {"topk": METHODS["topk"], "terngrad": METHODS["terngrad"], "powersgd": {"rank": 2}}
TOGETHER = 3


def config(method: str, sync_delay: int) -> dict[str, Any]:
    """TernGrad with the eager merge (the default) and an outer lr of ``"sqrt_twice_replicas"``,
    as the slow-link config; the others with the mix; Top-k (the failure runs) also with
    ``"sqrt_twice_replicas"``, which under the manager follows each sync's participants."""
    table = {"algorithm": "diloco", "period": 4, "fragments": 2, "sync_delay": sync_delay, "outer_momentum": 0.2}
    table["outer_lr"] = "sqrt_twice_replicas" if method in KILLED else 0.8
    if method != "terngrad":
        table["merge_alpha"] = 0.5
    return {"method": method, "params": {**METHODS, **KILLED}[method], "local_sgd": table}


def inner_step(net: nn.Module, opt: torch.optim.Optimizer, replica: int, step: int) -> None:
    x, y = batch(replica, step)
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad()


def same_runs(out: Path, lighthouse: str, port: int, replica: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=replica, world_size=2)
    manager = make_manager(replica, lighthouse, min_size=2)
    seen: dict[str, Any] = {}
    for method in [*METHODS, "local_sgd", "slow-link-h1"]:
        cfg = config(method, sync_delay=1) if method in METHODS else {"local_sgd": LOCAL_SGD, "slow-link-h1": H1}[method]
        plain = model(0)
        opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
        reg = commpress.register(plain, cfg, optimizer=opt)
        for step in range(STEPS):
            inner_step(plain, opt, replica, step)
        reg.finish()
        managed, trainer, first, state = resumed_run(cfg, manager, method, replica)
        seen[method] = {
            "commits": first.commits + trainer.commits,
            "model": all(torch.equal(a, b) for a, b in zip(plain.parameters(), managed.parameters())),
            "anchor": torch.equal(reg.local_sgd.anchor, trainer.anchor),
            "changed": not torch.equal(next(model(0).parameters()), next(managed.parameters())),
            "periods": trainer.clock.periods,
            "outcomes": state["outcomes"],
        }
    (out / f"same{replica}.json").write_text(json.dumps(seen))
    manager.shutdown(wait=False)


def resumed_run(
    cfg: dict[str, Any], manager: Any, key: str, replica: int, steps: int = STEPS
) -> tuple[nn.Module, Any, Any, dict[str, Any]]:
    """``steps`` inner steps of ``cfg`` through ``manager``, its trainer's state saved
    after :data:`SAVE_STEP` and loaded into a second trainer (registered at the start, so
    both count syncs from the same manager step) that takes the run over with copies of the
    model and optimizer: the resumed model, its trainer, the first trainer, the state."""
    nets = [model(0), model(0)]
    opts = [torch.optim.AdamW(net.parameters(), lr=0.01) for net in nets]
    trainers = [from_config(n, o, Config.load(cfg), manager=manager, key=f"{key}{i}") for i, (n, o) in enumerate(zip(nets, opts))]
    for trainer in trainers:
        trainer.register_optimizer_hooks()
    state: dict[str, Any] = {}
    for step in range(steps):
        run = int(step >= SAVE_STEP)
        inner_step(nets[run], opts[run], replica, step)
        if step + 1 == SAVE_STEP:
            state = trainers[0].state_dict()
            nets[1].load_state_dict(nets[0].state_dict())
            opts[1].load_state_dict(opts[0].state_dict())
            trainers[1].load_state_dict(copy.deepcopy(state))
    trainers[1].finish()
    return nets[1], trainers[1], trainers[0], state


def failing(scenario: str, out: Path, lighthouse: str, port: int, replica: int) -> None:
    role, _, method = scenario.partition("-")
    meet = dist.TCPStore("localhost", port, is_master=False, wait_for_workers=False)
    manager = make_manager(replica, lighthouse)
    # TernGrad: wide enough that the survivor's codes shrink when Huffman-coded (a 1.6 kB
    # payload of 2-bit codes, against about 0.1 kB at width 32, where the coder's 140-byte
    # table costs more than it saves), so the healing replica's payload, made incompressible by _spied, is longer
    net = model(7 if role == "joiner" else 0, hidden=256 if method == "terngrad" else 32)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    manager.register_state_dict_fn("model", net.load_state_dict, net.state_dict)
    manager.register_state_dict_fn("optimizer", opt.load_state_dict, opt.state_dict)
    module = {"topk": topk_kernels, "terngrad": ternary_kernels}.get(method)  # PowerSGD runs torch's own ops
    kernels = [f for f in vars(module).values() if hasattr(f, "signatures")] if module else []  # numba's, loaded on first use
    loaded = [any(f.signatures for f in kernels)]
    outside: list[bool] = []
    backend: list[ManagerBackend] = []
    terngrad.coded_gather = functools.partial(_spied, outside, backend)
    trainer = commpress.register(net, config(method, sync_delay=0), optimizer=opt, manager=manager).local_sgd
    backend.append(trainer.backend)
    loaded.append(any(f.signatures for f in kernels))  # at registration, before the first quorum
    begin(role, trainer, manager, meet)
    seen: dict[str, Any] = {"healed": False, "alone": 0, "participants": [], "lrs": [], "kernels": loaded, "outside": outside}
    deadline, step = time.monotonic() + 600, 0
    while time.monotonic() < deadline:
        before = snapshot(trainer)
        twin = copy.deepcopy(net)  # the step without its sync
        twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.01)
        twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        syncs = len(trainer.commits)
        inner_step(net, opt, replica, step)
        inner_step(twin, twin_opt, replica, step)
        step += 1
        if len(trainer.commits) == syncs:
            continue
        seen["participants"].append(trainer.backend.world_size)
        seen["lrs"].append(trainer.outer_optimizer.param_groups[0]["lr"])
        if not trainer.backend.participating:
            seen["healed"] = True
        if role == "survivor" and not trainer.commits[-1] and "failed_sync" not in seen:
            fragment = trainer.fragments[KILL_SYNC % len(trainer.fragments)]
            seen["failed_sync"] = syncs
            seen["kept"] = [
                *kept(before, trainer),
                torch.equal(trainer.flat.read(tensors=fragment.tensors), FlatModel(twin).read(tensors=fragment.tensors)),
                not torch.equal(trainer.flat.read(tensors=fragment.tensors), trainer.anchor[fragment.where]),
            ]
        if paced(seen, role == "survivor" and "failed_sync" in seen, trainer, manager, meet):
            break
    end(scenario, out, seen, net, trainer, manager)


def begin(role: str, trainer: Any, manager: Any, meet: dist.TCPStore) -> None:
    """The killed replica exits as it starts the average of sync :data:`KILL_SYNC`; the
    first two replicas start together, the restarted one once the survivor has synced alone."""
    if role == "killed":
        start = trainer.averager.start
        trainer.averager.start = lambda *a, **k: os._exit(0) if manager.current_step() == KILL_SYNC else start(*a, **k)
    meet_up(role, meet)


def snapshot(trainer: Any) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
    """The anchor, outer state and compressor state, copied."""
    outer, compressor = trainer.outer_optimizer.state_dict(), trainer.averager.compressor.state_dict()
    return trainer.anchor.clone(), copy.deepcopy(outer), copy.deepcopy(compressor)


def kept(before: tuple[torch.Tensor, dict[str, Any], dict[str, Any]], trainer: Any) -> list[bool]:
    """Whether the anchor, outer state and compressor state are as :func:`snapshot` saw them."""
    return [
        torch.equal(before[0], trainer.anchor),
        same(before[1], trainer.outer_optimizer.state_dict()),
        same(before[2], trainer.averager.compressor.state_dict()),
    ]


def paced(seen: dict[str, Any], recovered: bool, trainer: Any, manager: Any, meet: dist.TCPStore) -> bool:
    """After a sync: the survivor past the failed sync (``recovered``) counts syncs alone,
    leaving the restarted replica time to join, and once both sync sets the stop
    :data:`TOGETHER` syncs on; whether this replica is there."""
    if recovered and trainer.commits[-1]:
        if trainer.backend.world_size == 1:
            seen["alone"] += 1
            meet.set("alone", "1")  # the test starts the restarted replica now
            time.sleep(0.3)  # pace the syncs alone while the restarted replica starts
        elif not meet.check(["stop"]):
            meet.set("stop", str(manager.current_step() + TOGETHER))
    return meet.check(["stop"]) and manager.current_step() >= int(meet.get("stop"))


def end(name: str, out: Path, seen: dict[str, Any], net: nn.Module, trainer: Any, manager: Any) -> None:
    """Finish, and write the manager's step, the clock, the model and the shared state."""
    trainer.finish()
    seen["step"] = manager.current_step()
    seen["clock"] = trainer.clock.state_dict()
    torch.save({"model": net.state_dict(), "shared": trainer.shared_state_dict()}, out / f"{name}.pt")
    (out / f"{name}.json").write_text(json.dumps(seen))
    manager.shutdown(wait=False)


def _spied(
    outside: list[bool], backend: list[ManagerBackend], payload: torch.Tensor
) -> Generator[Collective, Any, list[torch.Tensor]]:
    """:func:`coded_gather`, noting for each gather whether this rank's coded payload was
    longer than the counted ranks' largest (its frame then says it holds nothing). While
    the replica heals, its payload is replaced by bytes that do not compress, so that case
    happens whatever the data: a healing replica's payload is dropped by its peers and its
    own replay, so no bits of the run change."""
    if backend and not backend[0].participating:
        payload = torch.randint(0, 256, payload.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def note(request: Collective) -> Collective:
        if isinstance(request, AllGather):
            outside.append(int(request.tensor[: entropy.HEADER_BYTES].view(torch.int32)[0]) == -1)
        return request

    return relayed(entropy.coded_gather(payload), before=note)


if __name__ == "__main__":
    run(same_runs, failing, sys.argv[1:])
