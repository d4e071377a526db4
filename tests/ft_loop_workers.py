"""Replica groups (one process each) for tests/test_ft_loop.py: the DiLoCo loop of
docs/fault_tolerance.md ("DiLoCo and Streaming DiLoCo under the manager"), as written there,
with the shipped docs/configs/slow-link.toml (period 2, ``sync_delay = 1``, TernGrad
entropy-coded, outer lr sqrt(2M)), under a torchft Manager built as the page builds it, with
the page's AdamW or Muon + AdamW (the test sets ``optimizer`` in the store); the lighthouse
runs in the test process.

Run as ``python ft_loop_workers.py ROLE OUTDIR LIGHTHOUSE STORE_PORT REPLICA``:

- ``start``: replica groups 0, 1 and 2 start together (they meet in the test's store
  before building their Managers). Replica 2 SIGKILLs itself as it starts the average of
  the sync at step :data:`KILL_STEP`, after its quorum: its peers' collective fails and that
  sync is not committed, so they log the lost peer and sync on alone. Replicas 0 and 1, the
  survivors, draw the batch of step :data:`GATE` only once the restarted replica has built
  its Manager (``ready`` in the store): without it a slow restart could come after the job
  ended, and train a job of its own. They pause between two steps, in no quorum, and the
  restarted replica sets ``ready`` before its first quorum, so no replica waits on one that
  waits (the lighthouse forms no quorum from half or less of the heartbeating replicas).
- ``restarted``: replica group 2 again, started by the test as soon as the killed process
  has exited; it joins at once.

A replica that ends writes ``OUTDIR/ROLE{REPLICA}.pt``: its job step and manager step, the
job step of every batch it drew, its syncs' commits and its model. The processes meet
through a TCPStore the test process holds (STORE_PORT), never through the group that breaks.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from manager_workers import make_manager
from torch import nn

import commpress

CONFIG = str(Path(__file__).resolve().parents[1] / "docs" / "configs" / "slow-link.toml")
TOTAL_STEPS = 30  # the job's steps
KILL_STEP = 8  # replica 2 dies starting the average of the sync at the end of this step
GATE = 17  # the survivors draw this step's batch once the restarted replica has built its Manager
WAIT = 300.0  # seconds, for an event expected within seconds


def wait_for(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT:.0f} s for {what}")
        time.sleep(0.05)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    """Cross-entropy towards class 0: any loss of the output alone, as the page's loop takes it."""
    return nn.functional.cross_entropy(out, torch.zeros(len(out), dtype=torch.long))


def stream(replica: int, step: Callable[[], int], before: Callable[[int], None], drawn: list[int]) -> Iterator[torch.Tensor]:
    """An endless stream of batches, each seeded by the replica and the job's step it is
    drawn at (noted in ``drawn``); ``before(step)`` runs first."""
    while True:
        at = step()
        drawn.append(at)
        before(at)
        yield torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * replica + at))


def dies_in_sync(trainer: Any) -> None:
    """Make this process SIGKILL itself as it starts the average of the sync at step
    :data:`KILL_STEP` (its quorum formed with it, so its peers' collective waits for it)."""
    start = trainer.averager.start

    def dying(*args: Any, **kwargs: Any) -> Any:
        if trainer.job_step == KILL_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        return start(*args, **kwargs)

    trainer.averager.start = dying


def inner_optimizers(module: nn.Module, name: str) -> list[torch.optim.Optimizer]:
    """``adamw``: the page's one AdamW; ``muon``: Muon on the hidden matrix, AdamW on the rest."""
    if name == "adamw":
        return [torch.optim.AdamW(module.parameters(), lr=1e-2)]
    hidden = module[0].weight
    rest = [p for p in module.parameters() if p is not hidden]
    return [torch.optim.Muon([hidden], lr=1e-2, adjust_lr_fn="match_rms_adamw"), torch.optim.AdamW(rest, lr=1e-2)]


def main(role: str, out: Path, lighthouse: str, port: int, replica: int) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    meet = dist.TCPStore("localhost", port, is_master=False, wait_for_workers=False)
    if role == "start":  # the first three start together, before any Manager heartbeats
        meet.add("started", 1)
        wait_for(lambda: int(meet.add("started", 0)) >= 3, "the three replica groups to start")

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    manager = make_manager(replica, lighthouse)  # this replica group's store and Manager
    manager.register_state_dict_fn("model", module.load_state_dict, module.state_dict)
    optimizers = inner_optimizers(module, meet.get("optimizer").decode())
    for i, opt in enumerate(optimizers):
        manager.register_state_dict_fn(f"optimizer{i}", opt.load_state_dict, opt.state_dict)
    reg = commpress.register(module, CONFIG, optimizer=optimizers, manager=manager, total_steps=TOTAL_STEPS)
    if role == "restarted":
        meet.set("ready", "1")  # before its first quorum: the survivors may go on
    if role == "start" and replica == 2:
        dies_in_sync(reg.local_sgd)

    def before(step: int) -> None:
        if role == "start" and step == GATE:
            wait_for(lambda: meet.check(["ready"]), "the restarted replica to build its Manager")

    drawn: list[int] = []
    data = stream(replica, lambda: reg.local_sgd.job_step, before, drawn)

    # the loop of docs/fault_tolerance.md, as written there
    while reg.local_sgd.job_step < TOTAL_STEPS:  # the job's step: a restarted replica takes its peers' when it heals
        batch = next(data)  # an endless stream: how many batches a replica draws is not fixed
        loss_fn(module(batch)).backward()
        for opt in optimizers:
            opt.step()  # the syncs run from their step hooks, once each has stepped
            opt.zero_grad()
    reg.finish()  # every replica at the same step: their last syncs pair up

    trainer = reg.local_sgd
    seen = {"job_step": trainer.job_step, "manager_step": manager.current_step(), "drawn": drawn}
    seen.update(commits=list(trainer.commits), model=module.state_dict())
    torch.save(seen, out / f"{role}{replica}.pt")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    role, outdir, address, store_port, index = sys.argv[1:6]
    main(role, Path(outdir), address, int(store_port), int(index))
