"""The one backend contract: run reduction generators as futures, issuing collectives in
the same order on every rank.

A reduction's later collectives are issued from completion callbacks, which on gloo run in a
timing-dependent order. So the ``i``-th collective a reduction issues in a scope goes to
channel ``(scope, i)``, its own communicator, where reductions take turns in the order they
started; bucket ``i``'s second collective can then overlap bucket ``i+1``'s compression. On
CUDA a queued request waits on an event of the stream that made its tensor. A failed collective
fails its reduction with a :class:`~commpress.errors.CollectiveError`, and every later one.
"""

from __future__ import annotations

import functools
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from commpress.comm.callbacks import when_done
from commpress.comm.counters import Traffic
from commpress.compressors.wire.collectives import SCOPES, AllGather, AllReduce, Collective, ReduceScatter, Reduction
from commpress.errors import CollectiveError

__all__ = ["Backend", "Channel", "OnBackend", "describe", "future_on"]

#: A channel: (scope, ordinal of the collective within that scope in one reduction).
Channel = tuple[str, int]


@dataclass
class _Task:
    seq: int
    gen: Reduction
    result: torch.futures.Future
    used: dict[str, int] = field(default_factory=dict)  # collectives issued per scope


@dataclass
class _Queue:
    next_seq: int = 0
    pending: dict[int, tuple[_Task, Collective, torch.cuda.Event | None]] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Backend(ABC):
    """Drives reductions; a subclass implements :meth:`_start` and :meth:`allgather_object`, and
    :meth:`members` where a scope is not every rank. ``rounds``: the most collectives one
    reduction issues, per scope (an int: ``"world"``). ``traffic`` counts every scope but
    ``"domain"`` (the slow links compression is for); ``domain_traffic`` the bytes inside fast domains."""

    def __init__(self, rank: int, world_size: int, rounds: int | Mapping[str, int]) -> None:
        rounds = {"world": rounds} if isinstance(rounds, int) else dict(rounds)
        for scope, n in rounds.items():
            if scope not in SCOPES:
                raise ValueError(f"unknown scope {scope!r}; accepted: {', '.join(SCOPES)}")
            if n < 1:
                raise ValueError(f"rounds of scope {scope!r} must be >= 1, got {n}")
        self.rank = rank
        self.world_size = world_size
        self.traffic = Traffic()
        self.domain_traffic = Traffic()
        self._queues = {(scope, i): _Queue() for scope, n in rounds.items() for i in range(n)}
        self._seq = 0
        self._failure: CollectiveError | None = None

    #: whether this rank may block on a collective alone (False when every rank runs in this thread)
    can_block: bool = True
    #: whether the ranks stay fixed, so they agree on settings once (False under a torchft Manager)
    fixed_members: bool = True

    # ---- the step's transaction (see ManagerBackend); a fixed group's step always commits ----
    #: whether this member takes part in the step (a healing replica does not)
    participating: bool = True
    #: whether a member of the step heals in it
    heals: bool = False
    #: per reduction of the step, its collectives' results, while this member heals
    log: list[list[Any]] | None = None

    def begin_step(self) -> None:
        """Begin a step; a fixed group has nothing to ask."""
        return None

    def open_step(self) -> None:
        """Begin a step of the caller's own (a trainer's sync)."""
        self.begin_step()

    def commit(self) -> bool:
        """End the step opened last; whether it counts."""
        return True

    def allow_state_reads(self, allowed: bool) -> None:
        """Whether a healing peer may read the shared state now."""
        return None

    def step_of(self, counted: int) -> int:
        """The number of the step begun, given the caller's own count."""
        return counted

    def committed(self) -> bool:
        """Whether the step begun last is committed."""
        return True

    def survived(self, exc: BaseException) -> bool:
        """Whether the run survives ``exc``, a failure of the step's collectives (else it is raised)."""
        return False

    def share_state(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        """Name the state a healing member takes from a peer."""
        return None

    @property
    def rounds(self) -> dict[str, int]:
        """How many collectives one reduction may issue, per scope."""
        return dict(Counter(scope for scope, _ in self._queues))

    @property
    def failure(self) -> CollectiveError | None:
        """The first collective failure this backend saw (later reductions fail with it)."""
        return self._failure

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), blocking; used for set-up checks only."""

    def members(self, scope: str) -> Sequence[int]:
        """The global ranks this rank talks to in ``scope`` (default: every rank)."""
        return list(range(self.world_size))

    @abstractmethod
    def _start(self, channel: Channel, request: Collective) -> torch.futures.Future:
        """Start ``request`` on ``channel``'s communicator; the future gives a tensor (a list of
        them for AllGather), or whatever the subclass's :meth:`_result` turns into one."""

    def _result(self, channel: Channel, request: Collective, fut: torch.futures.Future) -> Any:
        """The result of ``request`` once ``fut`` has completed; raises the collective's error."""
        return fut.value()

    def run(self, reduction: Reduction, device: torch.device | None = None) -> torch.futures.Future:
        """Run ``reduction`` on ``device``'s tensors (see :func:`future_on`), in the same order on
        every rank; the future completes with what it returns (whether its average is finite)."""
        task = _Task(self._seq, reduction, future_on(device))
        self._seq += 1
        self._advance(task, None)
        return task.result

    def _advance(self, task: _Task, result: Any) -> None:
        """Send ``result`` into the generator; queue its next request or finish it."""
        if self._failure is not None:
            task.gen.close()
            return self._finish(task, self._failure)
        t0 = time.perf_counter()
        try:
            request = task.gen.send(result)  # the first result is None: send(None) starts a generator
        except StopIteration as done:
            self.traffic.add(seconds=time.perf_counter() - t0)
            return self._finish(task, None, done.value)
        except BaseException as exc:  # the future carries it to whoever waits
            return self._finish(task, exc)
        self.traffic.add(seconds=time.perf_counter() - t0)
        if not isinstance(request, (AllReduce, AllGather, ReduceScatter)):
            return self._finish(task, TypeError(f"a reduction yielded {type(request).__name__}, not a collective"))
        channel = (request.scope, task.used.get(request.scope, 0))
        if channel not in self._queues:
            limit = self.rounds.get(request.scope, 0)
            error = RuntimeError(
                f"a reduction yielded more than {limit} collectives in scope {request.scope!r}; raise the compressor's `rounds`"
            )
            return self._finish(task, error)
        task.used[request.scope] = channel[1] + 1
        queue = self._queues[channel]
        with queue.lock:
            queue.pending[task.seq] = (task, request, _ready(request.tensor))
        self._pump(channel)

    def _finish(self, task: _Task, error: BaseException | None, returned: Any = None) -> None:
        """Release ``task``'s turns on the channels it did not use and complete its future."""
        for channel, queue in self._queues.items():
            if channel[1] >= task.used.get(channel[0], 0):
                with queue.lock:
                    queue.released.add(task.seq)
                self._pump(channel)
        if error is None:
            task.result.set_result(returned)
        else:
            task.result.set_exception(error)

    def _pump(self, channel: Channel) -> None:
        """Issue every request whose turn has come on ``channel``, in sequence order."""
        queue = self._queues[channel]
        started = []
        with queue.lock:
            while True:
                seq = queue.next_seq
                if seq in queue.released:
                    queue.released.discard(seq)
                elif seq in queue.pending:
                    task, request, ready = queue.pending.pop(seq)
                    if ready is not None:  # issued from another thread or stream than it was made on
                        torch.cuda.current_stream(request.tensor.device).wait_event(ready)
                    try:
                        fut = self._start(channel, request)
                    except BaseException as exc:
                        fut = torch.futures.Future()
                        fut.set_exception(exc)
                    started.append((task, request, fut))
                else:
                    break
                queue.next_seq += 1
        for task, request, fut in started:
            traffic = self.domain_traffic if channel[0] == "domain" else self.traffic
            traffic.add(nbytes=request.nbytes, collectives=1)
            when_done(fut, functools.partial(self._on_done, task, channel, request))

    def _on_done(self, task: _Task, channel: Channel, request: Collective, fut: torch.futures.Future) -> None:
        """Send the completed collective's result on, or fail ``task`` (and every later reduction)."""
        try:
            result = self._result(channel, request, fut)
        except BaseException as exc:
            error = CollectiveError(
                f"{describe(request)} on channel {channel[0]}/{channel[1]} over ranks "
                f"{list(self.members(channel[0]))} failed on rank {self.rank}: {exc}"
            )
            error.__cause__ = exc
            if self._failure is None:
                self._failure = error
            task.gen.close()
            return self._finish(task, error)
        self._advance(task, result)


def future_on(device: torch.device | None = None) -> torch.futures.Future:
    """A future whose waiters wait for ``device``'s current CUDA streams at completion (default:
    the current CUDA device once initialized); a plain future on the CPU."""
    if device is None and torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or device.type != "cuda" or not torch.cuda.is_available():  # (fake CUDA tensors in tests)
        return torch.futures.Future()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.futures.Future(devices=[torch.device("cuda", index)])


def _ready(tensor: torch.Tensor) -> torch.cuda.Event | None:
    if not tensor.is_cuda or not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


class OnBackend:
    """The rank, world size and traffic of the ``backend`` an object reduces through."""

    backend: Backend

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent and the time spent in compressor code (see :class:`Traffic`)."""
        return self.backend.traffic


def describe(request: Collective) -> str:
    """``all_reduce(sum, 1024 x float32)``: what a collective was, for error messages."""
    t = request.tensor
    shape = f"{t.numel()} x {str(t.dtype).removeprefix('torch.')}"
    if isinstance(request, AllReduce):
        return f"all_reduce({request.op}, {shape})"
    if isinstance(request, ReduceScatter):
        return f"reduce_scatter({shape})"
    return f"all_gather({shape})"
