"""How the CPU kernels split their work over threads, and how tensors reach them as numpy arrays.

Kernels work on numpy views (no copies); a call is cut into a few large spans per thread of
commpress's own pool. Half-precision inputs arrive as float32 blocks of ``CHUNK``, never copied whole.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

if sys.byteorder != "little":  # the kernels read a uint64 word as its two uint32 draws, low first
    raise ImportError("commpress.kernels CPU kernels need a little-endian machine")

# Elements per block: a multiple of 8 (whole bytes at every bit width), a float32 block (256 KiB)
# fits an L2 cache, and no span of :func:`parts` is shorter.
CHUNK = 1 << 16


def spans(n: int, chunk: int = CHUNK) -> Iterator[tuple[int, int]]:
    """Yield ``(start, stop)`` covering ``range(n)`` in blocks of ``chunk``."""
    for start in range(0, n, chunk):
        yield start, min(n, start + chunk)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU tensor (bfloat16 is not viewable)."""
    return t.detach().numpy()


def float32_block(x: torch.Tensor, start: int, stop: int) -> np.ndarray:
    """``x[start:stop]`` as a float32 numpy array: a view for float32, a converted copy otherwise."""
    return as_numpy(x[start:stop].float())


_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)


def _executor() -> ThreadPoolExecutor | None:
    """A pool of ``torch.get_num_threads()`` workers (None for one), re-created after a fork."""
    global _pool
    workers = torch.get_num_threads()
    if workers <= 1:
        return None
    if _pool is None or _pool[0] != os.getpid() or _pool[1] != workers:
        _pool = (os.getpid(), workers, ThreadPoolExecutor(workers, thread_name_prefix="commpress-cpu"))
    return _pool[2]


def map_blocks(body: Callable[..., object], blocks: Sequence[tuple]) -> list:
    """``[body(*block) for block in blocks]`` over torch's intra-op thread count: the kernels release
    the GIL, and the bodies write disjoint slices of their outputs."""
    pool = _executor() if len(blocks) > 1 else None
    if pool is None:
        return [body(*block) for block in blocks]
    return list(pool.map(lambda block: body(*block), blocks))


# Parts per worker thread: a few, so that a thread slowed by other load does not hold up the call.
_PARTS_PER_THREAD = 4


def parts(n: int, align: int) -> list[tuple[int, int]]:
    """``range(n)`` as spans starting at multiples of ``align``: one on one thread, else about
    ``_PARTS_PER_THREAD`` per thread, none shorter than ``CHUNK`` (rounded up to ``align``)."""
    workers = torch.get_num_threads()
    count = 1 if workers <= 1 else max(1, min(workers * _PARTS_PER_THREAD, n // CHUNK))
    step = -(-n // count)
    step = max(align, -(-step // align) * align)
    return list(spans(n, step)) if n else []


def float32_out(out: torch.Tensor, start: int, stop: int, fill: Callable[[int, np.ndarray], None]) -> None:
    """``fill(first, float32 array)`` over ``out[start:stop]``: in place for float32, else per block."""
    if out.dtype == torch.float32:
        fill(start, as_numpy(out[start:stop]))
        return
    for s, e in spans(stop - start):
        block = np.empty(e - s, np.float32)
        fill(start + s, block)
        out[start + s : start + e].copy_(torch.from_numpy(block))  # rounded to out's dtype (nearest-even)


def float32_pieces(x: torch.Tensor, start: int, stop: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(offset, float32 array)`` pieces of ``x[start:stop]``: one view for float32, else converted blocks."""
    if x.dtype == torch.float32:
        yield start, as_numpy(x[start:stop])
        return
    for s, e in spans(stop - start):
        yield start + s, float32_block(x, start + s, start + e)


def segment_items(lengths: np.ndarray, align: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Segments of ``lengths`` elements as ``(segment, start, stop)`` item arrays (starts multiples of
    ``align``), grouped like :func:`parts` into calls of about equal work: small segments share calls."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    workers = torch.get_num_threads()
    groups = 1 if workers <= 1 else max(1, min(workers * _PARTS_PER_THREAD, total // CHUNK))
    step = max(CHUNK, -(-total // groups))
    step = -(-step // align) * align
    counts = -(-lengths // step)
    segment = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
    within = np.arange(segment.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    start = within * step
    stop = np.minimum(start + step, lengths[segment])
    if groups == 1 or segment.size <= 1:
        return [(segment, start, stop)] if segment.size else []
    cuts = np.searchsorted(np.cumsum(stop - start), total * np.arange(1, groups) // groups, side="right")
    return [g for g in zip(*(np.split(a, cuts) for a in (segment, start, stop))) if g[0].size]


def whole_segments(lengths: np.ndarray) -> list[np.ndarray]:
    """Indices of the segments in consecutive groups of about equal total, like :func:`parts`; a
    segment is never split."""
    lengths = np.asarray(lengths, np.int64)
    workers = torch.get_num_threads()
    groups = 1 if workers <= 1 else max(1, min(workers * _PARTS_PER_THREAD, lengths.size))
    if groups == 1 or lengths.size <= 1:
        return [np.arange(lengths.size, dtype=np.int64)] if lengths.size else []
    ends = np.cumsum(lengths)
    cuts = np.searchsorted(ends, int(ends[-1]) * np.arange(1, groups) // groups, side="right")
    return [g for g in np.split(np.arange(lengths.size, dtype=np.int64), np.unique(cuts)) if g.size]
