"""The harness of the rank processes of tests/test_failures.py (tests/failure_workers.py
holds the scenarios and the entry point): the training setups a rank runs (DDP with the
commpress hook, Local SGD and CO2, FSDP2), how a survivor drives one into a failure and
records what it saw (``fail``, ``fail_concurrently``, ``Recorder``), and the file barriers
the ranks meet at. The scenarios import these names as they are, underscores included.
"""

from __future__ import annotations

import copy
import datetime
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import commpress
import commpress.fsdp
from commpress.comm.torch_backend import group_timeout
from commpress.errors import CollectiveError
from commpress.local_sgd import CO2, LocalSGD

#: the collective timeout of a case's groups once it is set to fail (:func:`short_timeout`)
TIMEOUT_S = 5.0
#: how long a survivor's failing call may take before the case is recorded as a hang: the
#: timeout plus the tests' margin plus a little, so a hang is told apart from a late error
HANG_S = TIMEOUT_S + 25.0
#: how long a rank waits at a file barrier for the others
BARRIER_S = 240.0
#: the timeout of every group while the ranks connect, set up the cases and run their
#: healthy steps: on a loaded machine one rank may reach a collective many seconds after its
#: peer, which must make the run slower, never red
CONNECT_S = 240.0
FSDP = {"weight_bits": 8, "grad_bits": 8, "min_numel": 0, "exclude": []}
FIRST_FAILING_STEP = 2


# ---- models and cases ---------------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two (nested) states differ: ``path: a -> b`` for plain values, the path for tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return [] if same else [path or "/"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}/ keys {sorted(map(str, a))} -> {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}/{i}")]
    return [] if a == b else [f"{path or '/'}: {a!r} -> {b!r}"]


class Case:
    """One training setup on every rank; ``step`` runs one training step."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def step(self, i: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """End of training (CO2 waits for its last background average here)."""

    def snapshot(self) -> Any:
        """The committed state a checkpoint taken now would hold (None: not checked)."""
        return None

    def failure(self) -> CollectiveError | None:
        """The first collective failure of the case's backend, where it has one."""
        return None

    def groups(self) -> list[Any]:
        """The process group the case was given, then the communicators its backend opened."""
        return []

    def channel_timeouts(self) -> list[float]:
        """The timeouts (s) of the communicators the case's backend opened."""
        return [group_timeout(g).total_seconds() for g in self.groups()[1:]]


class DDPCase(Case):
    """DDP with the commpress hook of ``config`` over ``group`` (None: the default group)."""

    def __init__(self, rank: int, config: dict[str, Any], group: Any = None) -> None:
        super().__init__(rank)
        self.group = group if group is not None else dist.group.WORLD
        self.ddp = DistributedDataParallel(_mlp(), process_group=group, bucket_cap_mb=0.002)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=0.05)
        self.state = commpress.register(self.ddp, config).hook

    def step(self, i: int) -> None:
        x, y = _batch(i, self.rank)
        self.opt.zero_grad()
        F.mse_loss(self.ddp(x), y).backward()
        self.opt.step()

    def snapshot(self) -> Any:
        return copy.deepcopy(self.state.state_dict())

    def _backend(self) -> Any:
        return self.state.adaptive.backend if self.state.adaptive is not None else self.state.backend

    def failure(self) -> CollectiveError | None:
        return self._backend().failure

    def groups(self) -> list[Any]:
        out = [self.group, *self.state.backend._comms.values()]
        if self.state.adaptive is not None:
            out += [*self.state.adaptive.backend._comms.values(), self.state.adaptive._links.group]
        return out


class LocalCase(Case):
    """Local SGD (period 1: an average every step) or CO2 on a plain module."""

    def __init__(self, rank: int, make: Callable[[nn.Module, torch.optim.Optimizer], LocalSGD]) -> None:
        super().__init__(rank)
        self.model = _mlp()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.trainer = make(self.model, self.opt)

    def step(self, i: int) -> None:
        x, y = _batch(i, self.rank)
        self.opt.zero_grad()
        F.mse_loss(self.model(x), y).backward()
        self.trainer.step()

    def finish(self) -> None:
        self.trainer.finish()

    def snapshot(self) -> Any:
        out = {"anchor": self.trainer.anchor.clone(), "rounds": self.trainer.clock.rounds}
        out["compressor"] = copy.deepcopy(self.trainer.averager.compressor.state_dict())
        if isinstance(self.trainer, CO2):
            out["momentum"] = self.trainer.momentum.clone()
        return out

    def failure(self) -> CollectiveError | None:
        return self.trainer.averager.backend.failure

    def groups(self) -> list[Any]:
        backend = self.trainer.averager.backend
        return [backend.group, *backend._comms.values()]


class FSDPCase(Case):
    """FSDP2 (fully_shard) with commpress's quantized collectives, on ``mesh``."""

    def __init__(self, rank: int, mesh: DeviceMesh, config: dict[str, Any] = FSDP) -> None:
        super().__init__(rank)
        self.mesh = mesh
        self.model = _mlp()
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.state = commpress.fsdp.apply(self.model, config)

    def step(self, i: int) -> None:
        x, y = _batch(i, self.rank)
        self.opt.zero_grad()
        F.mse_loss(self.model(x), y).backward()
        self.opt.step()

    def groups(self) -> list[Any]:
        return [self.mesh.get_group()]  # FSDP runs its collectives on the mesh's group itself


# ---- recording ----------------------------------------------------------------------------


def describe(exc: BaseException | None) -> dict[str, Any] | None:
    """What a test needs to know about an exception (JSON)."""
    if exc is None:
        return None
    cause = exc.__cause__
    return {
        "type": type(exc).__name__,
        "collective_error": isinstance(exc, CollectiveError),
        "message": str(exc)[:4000],
        "cause": None if cause is None else type(cause).__name__,
        "cause_message": None if cause is None else str(cause)[:1000],
    }


def _timed(fn: Callable[[], None]) -> tuple[BaseException | None, float]:
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # recorded for the test
        return exc, time.monotonic() - t0
    return None, time.monotonic() - t0


def fail(case: Case, first: int = FIRST_FAILING_STEP) -> dict[str, Any]:
    """Train from step ``first`` until something raises (at most 3 steps, then finish);
    then try one more step and finish, which must fail at once."""
    snapshot: Any = None

    def until_error() -> None:
        nonlocal snapshot
        for i in range(first, first + 3):
            snapshot = case.snapshot()  # what a checkpoint before the failing step holds
            case.step(i)
        snapshot = case.snapshot()
        case.finish()

    exc, elapsed = _timed(until_error)
    record: dict[str, Any] = {"raised": exc is not None, "elapsed": elapsed, "error": describe(exc)}
    if exc is None:
        return record
    after = case.snapshot()
    record["state_changes"] = None if after is None else differences(snapshot, after)
    failure = case.failure()
    record["failure"] = describe(failure)

    def again() -> None:
        case.step(first + 3)
        case.finish()

    exc2, elapsed2 = _timed(again)
    record["again"] = {"raised": exc2 is not None, "elapsed": elapsed2, "error": describe(exc2)}
    return record


def fail_concurrently(cases: dict[str, Any], run: Callable[[Any], dict[str, Any]] = fail) -> dict[str, Any]:
    """``run`` every case in its own thread (each has its own communicators), so the
    timeouts of a stalled peer overlap; a case still running after HANG_S is a hang."""
    records: dict[str, Any] = {}

    def one(name: str, case: Any) -> None:
        try:
            records[name] = run(case)
        except BaseException as exc:  # a failure of the harness itself
            records[name] = {"raised": True, "elapsed": -1.0, "error": describe(exc), "harness": True}

    t0 = time.monotonic()
    threads = {n: threading.Thread(target=one, args=(n, c), daemon=True) for n, c in cases.items()}
    for t in threads.values():
        t.start()
    for name, t in threads.items():
        t.join(max(0.0, HANG_S - (time.monotonic() - t0)))
        if t.is_alive():
            records[name] = {"raised": False, "hung": True, "elapsed": time.monotonic() - t0, "error": None}
    return dict(records)


class Recorder:
    """This rank's results, rewritten after every phase (a later crash keeps them)."""

    def __init__(self, out: Path, rank: int) -> None:
        self.path = out / f"rank{rank}.json"
        self.data: dict[str, Any] = {"rank": rank, "cases": {}, "info": {}}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def barrier(out: Path, name: str, rank: int, ranks: list[int]) -> None:
    """Wait (polling files) until every rank in ``ranks`` has reached ``name``."""
    (out / f"{name}.{rank}").touch()
    deadline = time.monotonic() + BARRIER_S
    while not all((out / f"{name}.{r}").exists() for r in ranks):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks did not reach {name} within {BARRIER_S} s")
        time.sleep(0.05)


def short_timeout(groups: list[Any]) -> None:
    """Give the default group and ``groups`` :data:`TIMEOUT_S`: done just before a case is
    driven into its failure, so that only the failing call runs under the short timeout."""
    for group in [dist.group.WORLD, *groups]:
        _set_pg_timeout(datetime.timedelta(seconds=TIMEOUT_S), group)


def arm(cases: dict[str, Case]) -> None:
    """Every group of ``cases`` (and the default group) to :data:`TIMEOUT_S`."""
    short_timeout([g for case in cases.values() for g in case.groups()])


def _groups(n: int) -> list[Any]:
    """``n`` fresh groups over every rank, under :data:`CONNECT_S` until they are armed."""
    return [dist.new_group(timeout=datetime.timedelta(seconds=CONNECT_S)) for _ in range(n)]
