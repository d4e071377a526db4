"""Measured traffic of a hierarchical reduction per group and step, as the traffic model predicts it.

Inside a :func:`recording`, an adaptive layer built there times its collectives and keeps itself
in the log, so a caller holding only a config can read the plan afterwards. :func:`measured`
never compares clocks across ranks: a collective's transfer time is its shortest wait among the
group's ranks; a step's time is the union of those intervals up to each collective's end; a
group's figure is a trimmed mean over steps after ``skip`` (DDP rebuilds its buckets after step 1).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from commpress.bandwidth.hierarchy import Hierarchy
from commpress.compressors.wire.collectives import Collective, Reduction, relayed

__all__ = ["CollectiveLog", "Measured", "Record", "active", "measured", "recording"]


@dataclass(frozen=True)
class Record:
    """One collective on one rank: ``ordinal`` counts its bucket's collectives in its scope,
    ``nbytes`` is the input, ``start``/``end`` this rank's clock (s) at request and result."""

    step: int
    bucket: int
    scope: str
    ordinal: int
    nbytes: int
    start: float
    end: float


@dataclass
class CollectiveLog:
    """Every collective of the adaptive layers built while it was active (``layer``: the last one)."""

    records: list[Record] = field(default_factory=list)
    layer: Any = None

    def wrap(self, reduction: Reduction, step: int, bucket: int) -> Reduction:
        """``reduction`` with each of its collectives timed into :attr:`records`."""
        counts: dict[str, int] = {}
        started: list[tuple[int, float]] = []

        def before(request: Collective) -> Collective:
            counts[request.scope] = counts.get(request.scope, -1) + 1
            started.append((counts[request.scope], time.perf_counter()))
            return request

        def after(request: Collective, _: Any) -> None:
            ordinal, start = started.pop()
            self.records.append(Record(step, bucket, request.scope, ordinal, request.nbytes, start, time.perf_counter()))

        return relayed(reduction, before, after)


_ACTIVE: list[CollectiveLog] = []


@contextmanager
def recording() -> Iterator[CollectiveLog]:
    """``with recording() as log:`` adaptive layers built inside time their collectives into ``log``."""
    log = CollectiveLog()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)


def active() -> CollectiveLog | None:
    """The innermost active log (None: not recording)."""
    return _ACTIVE[-1] if _ACTIVE else None


@dataclass(frozen=True)
class Measured:
    """One group's measured traffic: input bytes per rank and step, seconds per step, over ``steps`` steps."""

    name: str
    ranks: tuple[int, ...]
    steps: int
    payload_bytes: float
    seconds: float


def measured(records: Sequence[Sequence[Record]], hierarchy: Hierarchy, skip: int = 5) -> list[Measured]:
    """Every group's figures (in :meth:`Hierarchy.names` order) from ``records[rank]``."""
    out = []
    for name, scope, ranks in hierarchy.names():
        mine = {r: [rec for rec in records[r] if rec.scope == scope] for r in ranks}
        steps = sorted({rec.step for recs in mine.values() for rec in recs})
        steps = steps[min(skip, max(len(steps) - 1, 0)) :]
        shortest: dict[tuple[int, int, int], float] = {}
        for recs in mine.values():
            for rec in recs:
                key = (rec.step, rec.bucket, rec.ordinal)
                shortest[key] = min(shortest.get(key, rec.end - rec.start), rec.end - rec.start)
        seconds, nbytes = [], []
        for step in steps:
            per_rank = [[rec for rec in recs if rec.step == step] for recs in mine.values()]
            seconds.append(statistics.fmean(_busy(recs, shortest) for recs in per_rank))
            nbytes.append(statistics.fmean(sum(rec.nbytes for rec in recs) for recs in per_rank))
        out.append(Measured(name, ranks, len(steps), statistics.fmean(nbytes or [0.0]), _trimmed(seconds)))
    return out


def _busy(recs: Sequence[Record], shortest: dict[tuple[int, int, int], float]) -> float:
    """Length of the union of [end - transfer time, end] over ``recs``."""
    spans = sorted((rec.end - shortest[rec.step, rec.bucket, rec.ordinal], rec.end) for rec in recs)
    total, reach = 0.0, -float("inf")
    for start, end in spans:
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def _trimmed(values: Sequence[float], cut: float = 0.1) -> float:
    """The mean without the lowest and highest ``cut`` of ``values`` (0.0 if empty)."""
    if not values:
        return 0.0
    drop = int(len(values) * cut)
    kept = sorted(values)[drop : len(values) - drop]
    return statistics.fmean(kept)
