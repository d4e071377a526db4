"""The backend over a torchft ``Manager``: collectives go through the manager's reconfigurable
process group and errors to the manager, so a lost peer fails the step, not the run.

Not ``manager.allreduce``: it averages (compressors divide by ``ctx.world_size`` themselves)
and its future completes only once waited on. A healing replica contributes nothing (an
all-gather's extra byte drops its entry) and keeps the step's results (:attr:`ManagerBackend.log`)
to :func:`replay` on a healthy peer's state. One process group carries every collective, so
reductions run one after another to keep their order.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

from commpress.comm.backend import Backend, Channel, future_on
from commpress.comm.callbacks import when_done
from commpress.compressors.wire.collectives import AllGather, AllReduce, Collective, Finite, Reduction, relayed
from commpress.errors import CollectiveError

__all__ = ["ManagerBackend", "replay", "report"]

log = logging.getLogger("commpress.manager")

_OPS = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX}
_FAILED = object()  # what a failed collective's future hands back once reported
#: the prefix torch's futures give an exception raised in a callback (the type then survives only as text)
_IN_CALLBACK = "Got the following error when running the callback: "
#: a failed collective's or a non-finite average's error as such a text
_SURVIVED = re.compile(rf"^({re.escape(_IN_CALLBACK)})*(CollectiveError|FloatingPointError):")


class ManagerBackend(Backend):
    """Runs reductions over a ``torchft.Manager``; call :meth:`begin_step` before a step's first."""

    fixed_members = False

    def __init__(self, manager: Any, rounds: int | Mapping[str, int]) -> None:
        super().__init__(0, 1, rounds)
        self.manager = manager
        self._base = manager.current_step()  # steps are counted from here: 0 on every replica of a fresh job
        self._began_at: int | None = None  # the manager's step begun last
        self._tail: torch.futures.Future | None = None
        self._lock = threading.Lock()

    def begin_step(self) -> None:
        """Wait for the step's quorum and take its world size, this replica's rank and whether it
        heals (then it reads results as participant 0); forget the last step's failure."""
        m = self.manager
        self.world_size = m.num_participants()
        self.participating = m.is_participating()
        self.rank = (m.participating_rank() or 0) if self.participating else 0
        self.heals = m._pg.size() > self.world_size
        self._failure = None
        self.log = None if self.participating else []
        self._began_at = m.current_step()

    def open_step(self) -> None:
        """Ask the manager for a quorum, then :meth:`begin_step`."""
        self.manager.start_quorum()
        self.begin_step()

    def commit(self) -> bool:
        """``should_commit()``: whether every participant's step succeeded."""
        return bool(self.manager.should_commit())

    def allow_state_reads(self, allowed: bool) -> None:
        """Let a healing peer read the shared state (between inner steps), or not."""
        if allowed:
            self.manager.allow_state_dict_read()
        else:
            self.manager.disallow_state_dict_read()

    def step_of(self, counted: int) -> int:
        """Committed steps since this backend was made (the same on every replica)."""
        return self.manager.current_step() - self._base

    def committed(self) -> bool:
        """Whether ``should_commit()`` moved the manager's step on past the one begun last."""
        return self._began_at is None or self.manager.current_step() > self._began_at

    def survived(self, exc: BaseException) -> bool:
        """A failed step is reported to the manager, which does not commit it: the run goes on."""
        report(self.manager, exc)
        return True

    def share_state(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        """Register ``save`` and ``load`` with the manager: a healing replica loads a peer's ``save()``."""
        self.manager.register_state_dict_fn(key, load, save)

    def allgather_object(self, obj: Any) -> list[Any]:
        raise RuntimeError(
            "under a torchft Manager the replicas change between steps: save each replica's own state_dict() "
            "(not full=True); a rejoining replica gets the shared state from a healthy peer"
        )

    def run(self, reduction: Reduction, device: torch.device | None = None) -> torch.futures.Future:
        """:meth:`Backend.run`, started once the previous reduction has ended."""
        if self.log is not None:
            entry: list[Any] = []
            self.log.append(entry)
            reduction = relayed(reduction, after=lambda _, result: entry.append(_cloned(result)))
        out = future_on(device)
        with self._lock:
            previous, self._tail = self._tail, out

        def start(_: Any = None) -> None:
            Backend.run(self, reduction, device).add_done_callback(functools.partial(_forward, out))

        if previous is None:
            start()
        else:
            previous.add_done_callback(start)
        return out

    def _start(self, channel: Channel, request: Collective) -> torch.futures.Future:
        m = self.manager
        if m.errored() is not None:
            raise CollectiveError(f"the manager already failed this step: {m.errored()}")
        pg = m._pg  # the manager's reconfigurable group (what torchft's ManagedProcessGroup uses)
        if isinstance(request, AllReduce):
            tensor = request.tensor
            if not self.participating:
                tensor.fill_(_identity(request.op, tensor.dtype))
            opts = AllreduceOptions()
            opts.reduceOp = _OPS[request.op]
            return self._checked(pg.allreduce([tensor], opts).get_future(), lambda: tensor)
        if not isinstance(request, AllGather):
            raise ValueError(f"{type(request).__name__} does not run under a torchft Manager (all-reduce and all-gather do)")
        flat = request.tensor.reshape(-1).contiguous()
        send = torch.empty(flat.numel() * flat.element_size() + 1, dtype=torch.uint8, device=flat.device)
        send[:-1].copy_(flat.view(torch.uint8))
        send[-1] = int(self.participating)
        out = [torch.empty_like(send) for _ in range(pg.size())]
        work = pg.allgather([out], [send], AllgatherOptions())
        return self._checked(work.get_future(), lambda: [o[:-1].view(flat.dtype) for o in out if o[-1].item()])

    def _checked(self, fut: torch.futures.Future, result: Callable[[], Any]) -> torch.futures.Future:
        """``fut`` through the manager's error path (timeout, ``report_error``), failing on error."""

        def done(f: torch.futures.Future) -> Any:
            if f.value() is _FAILED:
                raise CollectiveError(f"reported to the torchft Manager: {self.manager.errored()}")
            return result()

        wrapped = _reported(self.manager, fut).then(done)
        # torchft's callbacks go on after completing ``wrapped``: count an empty one after them (comm/callbacks.py)
        when_done(fut, lambda _: None)
        return wrapped


def _reported(manager: Any, fut: torch.futures.Future) -> torch.futures.Future:
    """``manager.wrap_future(fut, _FAILED)`` without its traceback log."""
    from torchft.futures import future_timeout

    def swallowed(f: torch.futures.Future) -> Any:
        try:
            return f.value()
        except Exception as exc:
            manager.report_error(exc)
            return _FAILED

    return future_timeout(fut, manager._timeout).then(swallowed)  # the timeout wrap_future takes


def report(manager: Any, exc: Exception) -> None:
    """Fail the manager's step with ``exc``: one WARNING line for a failed collective or a
    non-finite average, which a retry survives; anything else at ERROR with its traceback."""
    if isinstance(exc, (CollectiveError, FloatingPointError)) or _SURVIVED.match(str(exc)):
        log.warning("step %s will not be committed: %s", manager.current_step(), _first_line(exc))
    else:
        log.error("the step failed and will not be committed: %s", exc, exc_info=exc)
    manager.report_error(exc)


def _first_line(exc: BaseException) -> str:
    """``exc``'s message without the callbacks' prefixes and the traceback torch appends."""
    return str(exc).replace(_IN_CALLBACK, "").split("\n", 1)[0]


def _identity(op: str, dtype: torch.dtype) -> float:
    """The identity of all-reduce ``op``: what a healing replica contributes."""
    if op == "sum":
        return 0
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _forward(out: torch.futures.Future, fut: torch.futures.Future) -> None:
    try:
        out.set_result(fut.value())
    except BaseException as exc:
        out.set_exception(exc)


def _cloned(result: Any) -> Any:
    return [t.clone() for t in result] if isinstance(result, list) else result.clone()


def replay(reduction: Reduction, results: list[Any]) -> Finite:
    """Run ``reduction`` on recorded ``results`` instead of communicating."""
    try:
        request = next(reduction)
        for result in results:
            sent = request.tensor.copy_(result) if isinstance(request, AllReduce) else [t.clone() for t in result]
            request = reduction.send(sent)
    except StopIteration as done:
        return done.value
    reduction.close()
    raise RuntimeError(f"the replayed reduction asked for more than the {len(results)} collectives recorded")
