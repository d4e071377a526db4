"""Runs generator compressors as futures, issuing collectives in the same order on every rank.

Why ordered channels: collectives on one communicator must be issued in the same order on
all ranks. A compressor's first round is issued from the calling thread (DDP's hook, in
bucket order), but later rounds are issued from completion callbacks, which on gloo run on
worker threads in a timing-dependent order. Here round ``r`` of every reduction goes to
channel ``r`` (its own communicator), and each channel issues strictly in the order the
reductions were started, a reduction that ends before round ``r`` releasing its turn. So
bucket ``i``'s second round can run while bucket ``i+1`` is still compressing, and every
rank still issues the same sequence on every communicator.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from commpress.comm.traffic import Traffic
from commpress.compressors.base import AllGather, AllReduce, Collective, Reduction

__all__ = ["Backend"]


@dataclass
class _Task:
    seq: int
    gen: Reduction
    result: torch.futures.Future
    value: Any
    round: int = 0


@dataclass
class _Channel:
    next_seq: int = 0
    pending: dict[int, tuple[_Task, Collective]] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Backend(ABC):
    """Drives reductions; subclasses only say how to start one collective on one channel."""

    def __init__(self, rank: int, world_size: int, rounds: int) -> None:
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.rank = rank
        self.world_size = world_size
        self.traffic = Traffic()
        self._channels = [_Channel() for _ in range(rounds)]
        self._seq = 0

    @property
    def rounds(self) -> int:
        """How many collective rounds one reduction may use."""
        return len(self._channels)

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), blocking; used for set-up checks only."""

    @abstractmethod
    def _start(self, channel: int, request: Collective) -> torch.futures.Future:
        """Start ``request`` on ``channel``'s communicator; the future gives the result
        (a tensor for AllReduce, a list of tensors for AllGather)."""

    def run(self, reduction: Reduction, value: Any = None) -> torch.futures.Future:
        """Run ``reduction``; the returned future completes with ``value`` when it ends.

        Must be called in the same order on every rank (DDP calls hooks in bucket order).
        """
        task = _Task(self._seq, reduction, torch.futures.Future(), value)
        self._seq += 1
        self._advance(task, None)
        return task.result

    def _advance(self, task: _Task, result: Any) -> None:
        """Step the generator with ``result``; queue its next request or finish it."""
        t0 = time.perf_counter()
        try:
            request = task.gen.send(result) if task.round else next(task.gen)
        except StopIteration:
            self.traffic.add(seconds=time.perf_counter() - t0)
            self._release_from(task, task.round)
            task.result.set_result(task.value)
            return
        except BaseException as exc:  # the future carries it to whoever waits
            self._release_from(task, task.round)
            task.result.set_exception(exc)
            return
        self.traffic.add(seconds=time.perf_counter() - t0)
        if not isinstance(request, (AllReduce, AllGather)):
            self._release_from(task, task.round)
            task.result.set_exception(TypeError(f"a compressor yielded {type(request).__name__}, not a collective"))
            return
        if task.round >= self.rounds:
            self._release_from(task, self.rounds)
            task.result.set_exception(
                RuntimeError(f"a reduction yielded more than {self.rounds} collectives; raise the compressor's `rounds`")
            )
            return
        with self._channels[task.round].lock:
            self._channels[task.round].pending[task.seq] = (task, request)
        self._pump(task.round)

    def _release_from(self, task: _Task, first: int) -> None:
        """``task`` will use none of the channels from ``first`` on: give up its turns."""
        for index in range(first, self.rounds):
            with self._channels[index].lock:
                self._channels[index].released.add(task.seq)
            self._pump(index)

    def _pump(self, index: int) -> None:
        """Issue every request whose turn has come on channel ``index``, in sequence order."""
        channel = self._channels[index]
        started = []
        with channel.lock:
            while True:
                seq = channel.next_seq
                if seq in channel.released:
                    channel.released.discard(seq)
                elif seq in channel.pending:
                    task, request = channel.pending.pop(seq)
                    started.append((task, request, self._start(index, request)))
                else:
                    break
                channel.next_seq += 1
        for task, request, fut in started:
            self.traffic.add(nbytes=request.nbytes, collectives=1)
            task.round += 1
            fut.then(self._callback(task))

    def _callback(self, task: _Task) -> Callable[[torch.futures.Future], None]:
        def on_done(fut: torch.futures.Future) -> None:
            try:
                result = fut.value()
            except BaseException as exc:
                self._release_from(task, task.round)
                task.result.set_exception(exc)
                return
            self._advance(task, result)

        return on_done
